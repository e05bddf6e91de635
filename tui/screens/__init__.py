"""The app's screens: loading, chat, settings, help and a yes/no question."""

from .chat import ChatScreen
from .confirm import ConfirmScreen
from .help import HelpScreen
from .loading import LoadingScreen
from .settings import SettingsScreen

__all__ = ["ChatScreen", "ConfirmScreen", "HelpScreen", "LoadingScreen", "SettingsScreen"]
