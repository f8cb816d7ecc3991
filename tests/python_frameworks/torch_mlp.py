"""PyTorch with cubuf as its allocator (CUDAPluggableAllocator over
cubuf_torch_alloc / cubuf_torch_free) trains an MLP on random data to the
same losses, bit for bit, as with PyTorch's own allocator. The allocator can
only be chosen before CUDA's first use, so each run is its own process.

With --log PATH a third run serves PyTorch from a logging adaptor
(cubuf/adaptor.h) over the device pool, set with cubuf_framework_set_resource,
and writes the training loop's allocations to PATH for `cubuf replay`; its
losses must match too.

usage: torch_mlp.py LIBCUBUF [--log PATH]  (exit 0 same losses, 1 not, 77 skipped)
"""
import ctypes
import json
import os
import subprocess
import sys

STEPS = 300


class LogOptions(ctypes.Structure):
    # cubuf_log_options_t (include/cubuf/adaptor.h)
    _fields_ = [("struct_size", ctypes.c_size_t), ("path", ctypes.c_char_p),
                ("callback", ctypes.c_void_p), ("user", ctypes.c_void_p)]


def logging_resource(lib, path):
    """A logging adaptor over device 0's pool, made device 0's framework resource."""
    c = ctypes.CDLL(lib)
    vp = ctypes.c_void_p
    c.cubuf_device_resource_create.argtypes = [ctypes.c_int, vp, ctypes.POINTER(vp)]
    c.cubuf_log_adaptor_create.argtypes = [vp, ctypes.POINTER(LogOptions), ctypes.POINTER(vp)]
    c.cubuf_framework_set_resource.argtypes = [ctypes.c_int, vp]
    c.cubuf_log_adaptor_flush.argtypes = [vp]
    pool, log = vp(), vp()
    opts = LogOptions(ctypes.sizeof(LogOptions), path.encode(), None, None)
    for st in (lambda: c.cubuf_device_resource_create(0, None, ctypes.byref(pool)),
               lambda: c.cubuf_log_adaptor_create(pool, ctypes.byref(opts), ctypes.byref(log)),
               lambda: c.cubuf_framework_set_resource(0, log)):
        if st() != 0:
            raise RuntimeError("cubuf setup failed")
    return lambda: c.cubuf_log_adaptor_flush(log)


def train(mode, lib, log_path=None):
    import torch
    flush = logging_resource(lib, log_path) if mode == "log" else None
    if mode in ("cubuf", "log"):
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "cubuf_torch_alloc", "cubuf_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(STEPS, 128, 256, generator=g)
    labels = torch.randint(0, 10, (STEPS, 128), generator=g)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    ptrs = [p.data_ptr() for p in model.parameters()]
    for i in range(STEPS):
        x = data[i].to(dev, non_blocking=False)
        y = labels[i].to(dev)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        ptrs.append(x.data_ptr())
        losses.append(loss.item().hex())
    torch.cuda.synchronize()
    out = {"losses": losses, "misaligned": sum(1 for p in ptrs if p % 512)}
    if flush and flush() != 0:
        raise RuntimeError("cubuf_log_adaptor_flush failed")
    if mode == "cubuf":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import cubuf_stats
        out["stats"] = cubuf_stats.read(lib, 0)
    print(json.dumps(out))


def main():
    if len(sys.argv) >= 4 and sys.argv[2] == "--child":
        train(sys.argv[3], sys.argv[1], sys.argv[4] if len(sys.argv) > 4 else None)
        return 0
    lib = os.path.abspath(sys.argv[1])
    log_path = os.path.abspath(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--log" else None
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no torch here
        print("SKIP: torch does not import: %s" % e)
        return 77
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    runs = {}
    for mode in ("native", "cubuf") + (("log",) if log_path else ()):
        args = [sys.executable, __file__, lib, "--child", mode] + ([log_path] if mode == "log" else [])
        p = subprocess.run(args, env=env,
                           capture_output=True, text=True, timeout=500)
        if p.returncode != 0:
            print("%s run failed (%d):\n%s%s" % (mode, p.returncode, p.stdout, p.stderr))
            return 1
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    a, b = runs["native"]["losses"], runs["cubuf"]["losses"]
    s = runs["cubuf"]["stats"]
    print("losses: first %s, last %s (native) / %s (cubuf)" % (a[0], a[-1], b[-1]))
    print("cubuf: %d hits, %d cross-stream, %d misses, %d upstream allocations, peak %d bytes" %
          (s["hits"], s["cross_stream_reuses"], s["misses"], s["upstream_allocations"],
           s["peak_held_bytes"]))
    ok = True
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    if len(a) != STEPS or len(b) != STEPS or diff:
        print("FAIL: the losses differ at %d steps, first at %s" % (len(diff), diff[:1]))
        ok = False
    if s["hits"] < STEPS or s["misses"] == 0:
        print("FAIL: cubuf did not serve the run (%d hits, %d misses)" % (s["hits"], s["misses"]))
        ok = False
    if log_path:
        with open(log_path) as f:
            events = sum(1 for line in f if not line.startswith("#"))
        print("log: %d events in %s (cubuf replay %s --resource caching)" % (events, log_path, log_path))
        if runs["log"]["losses"] != a or events < 2 * STEPS:
            print("FAIL: the logged run differs or logged too little (%d events)" % events)
            ok = False
    if runs["cubuf"]["misaligned"]:
        print("FAIL: %d tensors not 512-byte aligned with cubuf" % runs["cubuf"]["misaligned"])
        ok = False
    print("same losses, bit for bit, over %d steps" % STEPS if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
