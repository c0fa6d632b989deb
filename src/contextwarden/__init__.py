"""contextwarden: keep every chat inside a token budget; record what each reply cost."""

__version__ = "0.1.0"
