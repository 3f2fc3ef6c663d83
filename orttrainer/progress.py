"""One line per slow phase of a build (export, gradient graph, sessions, the first-step check) through the
``orttrainer`` logger: a large model's first step takes minutes, and its user should see what it spent them on.

Quiet for small models (a phase under ``SLOW_PHASE_SECONDS`` says nothing); silenced, as transformers' logs are,
with ``logging.getLogger("orttrainer").setLevel(logging.WARNING)``. Until the program configures that logger
itself, it prints "orttrainer: ..." lines to stderr at INFO and above, and does not pass them on to the root
logger as well.
"""

import contextlib
import logging
import time

SLOW_PHASE_SECONDS = 2.0

logger = logging.getLogger("orttrainer")
if not logger.handlers and logger.level == logging.NOTSET:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("orttrainer: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_SAID = set()


def say_once(message: str) -> None:
    """Log ``message`` at INFO, once per process."""
    if message not in _SAID:
        _SAID.add(message)
        logger.info(message)


def size_of(tensors) -> str:
    """'124.4M parameters, 0.46 GiB': the element count and bytes of ``tensors``."""
    tensors = list(tensors)
    count = sum(tensor.numel() for tensor in tensors)
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return f"{count / 1e6:.1f}M parameters, {size / 2**30:.2f} GiB"


@contextlib.contextmanager
def phase(done: str):
    """Log '<done> in <seconds> s' when the block took ``SLOW_PHASE_SECONDS`` or more (and ended without error)."""
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds >= SLOW_PHASE_SECONDS:
        logger.info("%s in %.1f s", done, seconds)
