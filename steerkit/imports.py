"""Third-party imports steerkit makes quietly: :func:`quiet_optional_imports`.

transformers' integrations import optional packages when they are installed (torchao, on every
``import transformers.modeling_utils``); their import-time messages concern features steerkit does not use.
"""
from __future__ import annotations

import contextlib
import logging

#: loggers of optional libraries that transformers imports while loading a model when they are installed,
#: whose import-time warnings concern features steerkit does not use (torchao's CUDA-only extensions,
#: torch's notice about how torchao registers enums)
QUIET_ON_LOAD = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_optional_imports():
    """Hold the :data:`QUIET_ON_LOAD` loggers at ERROR while a model loads, then restore them.

    Examples:
        >>> import logging
        >>> before = logging.getLogger("torchao").level
        >>> with quiet_optional_imports():
        ...     print(logging.getLogger("torchao").level == logging.ERROR)
        True
        >>> logging.getLogger("torchao").level == before
        True
    """
    loggers = [logging.getLogger(n) for n in QUIET_ON_LOAD]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)
