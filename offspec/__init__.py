"""offspec: chat with a model that does not fit in your GPU, fast and losslessly (SpecExec trees)."""

from offspec.util.threads import openmp_env_defaults as _openmp_env_defaults

_openmp_env_defaults()  # first, before anything imports torch: OpenMP threads wait passively (offspec/util/threads.py)

from .config import GenerationConfig, LoadConfig, OutputConfig, SamplingConfig, TreeConfig
from .errors import OffspecError
from .types import GenerationResult, ModelInfo, PassStats, TextDelta, TokenLogprob, TreeSnapshot
from .version import __version__  # noqa: E402


def load(target=None, draft=None, **options):
    """Load a target and a draft (None = the default pair) and return a `Generator`. See `offspec.api.load`."""
    from .api import load as _load  # lazy on purpose: `import offspec` stays light (no torch) until a load

    return _load(target, draft, **options)


__all__ = ["load", "OffspecError", "TreeConfig", "SamplingConfig", "GenerationConfig", "LoadConfig", "OutputConfig",
           "GenerationResult", "PassStats", "TextDelta", "TokenLogprob", "TreeSnapshot", "ModelInfo", "__version__"]
