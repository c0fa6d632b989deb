"""contextwarden: keep every chat inside a token budget; record what each reply cost.

    >>> from contextwarden import trim_messages
    >>> messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    >>> result = trim_messages(messages, max_tokens=8_000, model="gpt-4o")
    >>> result.messages == messages  # what to send: here all of it, it fits
    True

For Open WebUI, paste `open_webui_filter.py` (built from this package) as a Function, or
`from contextwarden import Filter` in a two-line function.
"""

__version__ = "0.1.0"

import logging

from .core.decision import TrimDecision
from .core.tokens import TokenCounter, encoding_for
from .core.trim import TrimResult, trim_messages
from .errors import ConfigError, ContextWardenError, PricingError
from .face.filter import Filter
from .tools.explain import Explanation, explain_trim

# A library logs through its own logger and lets the application choose handlers: without one,
# warnings would reach stderr through logging's last resort (e.g. in the command line).
# No module logs while it is imported, so attaching the handler after the imports is enough.
logging.getLogger("contextwarden").addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    "Filter",
    "trim_messages",
    "TrimResult",
    "TrimDecision",
    "explain_trim",
    "Explanation",
    "TokenCounter",
    "encoding_for",
    "ContextWardenError",
    "ConfigError",
    "PricingError",
]
