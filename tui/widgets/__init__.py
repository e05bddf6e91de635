"""The chat screen's widgets."""

from .chat_list import ChatList
from .chat_view import ChatView
from .message import MessageBubble
from .reasoning import ReasoningFold
from .status_line import StatusLine
from .tree_panel import TreePanel

__all__ = ["ChatList", "ChatView", "MessageBubble", "ReasoningFold", "StatusLine", "TreePanel"]
