"""Context.from_numba / Context.to_numba: reading and making numba-cuda's context objects."""


def _as_int(handle):
    # numba-cuda hands out cuda.bindings objects (int() converts them) or,
    # with its ctypes binding, c_void_p (whose value is the address).
    value = getattr(handle, "value", None)
    if value is not None and not isinstance(handle, int):
        return int(value)
    return int(handle)


def context_handle(context):
    """The CUcontext of a numba context (None: numba's current context) as an int."""
    if context is None:
        from numba import cuda
        context = cuda.current_context()
    return _as_int(context.handle)


def to_numba(args):
    """numba's Context for (device_number, handle): its own object for the
    device's primary context, else a numba Context wrapping handle."""
    device_number, handle = args
    from numba.cuda.cudadrv import devices, driver
    ctx = devices.get_context(device_number)  # numba's object for the primary context
    if _as_int(ctx.handle) == handle:
        return ctx
    try:
        from cuda.bindings import driver as binding
        h = binding.CUcontext(handle)
    except ImportError:  # numba's ctypes binding
        import ctypes
        h = ctypes.c_void_p(handle)
    return driver.Context(ctx.device, h)
