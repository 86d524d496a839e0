"""Errors fastkit raises for bad input: each says what is wrong and what to do."""


class FastkitError(ValueError):
    """Bad input caught before any work is lost. The message names the field and the fix."""


class GPUOnlyError(FastkitError):
    """An option that needs a CUDA GPU was asked for on a machine without one."""
