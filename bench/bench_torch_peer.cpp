// PyTorch's caching allocator (c10::cuda::CUDACachingAllocator, C++ API:
// raw_alloc_with_stream + raw_delete), cubuf's caching resource through the
// same entry points PyTorch's pluggable allocator calls (cubuf_torch_alloc /
// cubuf_torch_free) and the raw driver pool pair (cuMemAllocFromPoolAsync +
// cuMemFreeAsync on a private pool keeping its memory), side by side in one
// process: allocate + free on one stream at 256 B, 4 KiB, 64 KiB, 1 MiB and
// 64 MiB, then 8 threads on 8 streams against 1 thread at 4 KiB and with
// random sizes 256 B - 1 MiB. Ratios printed; targets: cubuf <= 0.25x
// PyTorch up to 1 MiB. With a logging adaptor's log as argument
// (bench_torch_peer LOG, e.g. tests/python_frameworks/torch_mlp.py's), the
// three sides also replay it, in the log's order on one stream; target:
// cubuf faster than both. Built on the device by bench/build_torch_peer.sh.
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <cubuf.h>
#include <cubuf/caching.h>

namespace {

// The few driver entry points the raw side needs, from libcuda.so.1.
struct Driver {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_sync)(CUstream);
    CUresult (*pool_create)(CUmemoryPool *, const CUmemPoolProps *);
    CUresult (*pool_set)(CUmemoryPool, CUmemPool_attribute, void *);
    CUresult (*alloc_from_pool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
    CUresult (*free_async)(CUdeviceptr, CUstream);
} drv;

void die(const char *what, int code)
{
    std::fprintf(stderr, "error: %s failed (%d)\n", what, code);
    std::exit(1);
}

#define DRV(call)                                          \
    do {                                                   \
        CUresult r_ = (call);                              \
        if (r_ != CUDA_SUCCESS) die(#call, (int)r_);       \
    } while (0)

CUresult (*get_proc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

// Each entry point at the 12.0 ABI, as cubuf's driver table resolves them.
template <typename F>
void sym(const char *name, F &f)
{
    void *p = nullptr;
    CUdriverProcAddressQueryResult q;
    if (get_proc(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS || !p) die(name, -1);
    f = reinterpret_cast<F>(p);
}

CUcontext g_ctx;
CUmemoryPool g_pool;

enum Side { TORCH, CUBUF, RAW };
const char *const k_names[] = {"pytorch", "cubuf", "raw pool"};

inline void op(Side side, size_t size, CUstream s)
{
    if (side == TORCH) {
        void *p = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size, s);
        c10::cuda::CUDACachingAllocator::raw_delete(p);
    } else if (side == CUBUF) {
        void *p = cubuf_torch_alloc(size, 0, s);
        if (!p) die(cubuf_last_error(), 0);
        cubuf_torch_free(p, size, 0, s);
    } else {
        CUdeviceptr p = 0;
        DRV(drv.alloc_from_pool(&p, size, g_pool, s));
        DRV(drv.free_async(p, s));
    }
}

double now()
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Nanoseconds per allocate + free: the median of 21 batches of n, the three
// sides interleaved batch by batch.
void one_stream(size_t size, CUstream s, double ns[3])
{
    const long n = size >= (64u << 20) ? 500 : 5000;
    std::vector<double> t[3];
    for (int w = 0; w < 3; w++)
        for (long i = 0; i < n; i++) op(Side(w), size, s);
    for (int r = 0; r < 21; r++)
        for (int k = 0; k < 3; k++) {
            int w = (k + r) % 3;
            DRV(drv.stream_sync(s));
            double t0 = now();
            for (long i = 0; i < n; i++) op(Side(w), size, s);
            DRV(drv.stream_sync(s));
            t[w].push_back((now() - t0) / double(n) * 1e9);
        }
    for (int w = 0; w < 3; w++) {
        std::sort(t[w].begin(), t[w].end());
        ns[w] = t[w][t[w].size() / 2];
    }
}

// Allocate + free per second of `threads` threads, each on its own stream, for 0.3 s.
double throughput(Side side, int threads, bool random, std::vector<CUstream> &streams)
{
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<long> ops(threads, 0);
    std::vector<std::thread> th;
    double t0 = 0;
    for (int i = 0; i < threads; i++)
        th.emplace_back([&, i] {
            DRV(drv.ctx_set(g_ctx));
            uint64_t x = 0x9E3779B97F4A7C15ULL * uint64_t(i + 1);
            ready++;
            while (!go.load()) {
            }
            double end = now() + 0.3;
            long k = 0;
            for (; (k & 63) || now() < end; k++) {
                size_t size = 4096;
                if (random) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    size = 256 + size_t(x % ((1u << 20) - 255));
                }
                op(side, size, streams[i]);
            }
            DRV(drv.stream_sync(streams[i]));
            ops[i] = k;
        });
    while (ready.load() < threads) {
    }
    t0 = now();
    go = true;
    long total = 0;
    for (int i = 0; i < threads; i++) {
        th[i].join();
        total += ops[i];
    }
    return double(total) / (now() - t0);
}

// A log's successful events in order: allocations numbered, each free
// naming its allocation; what the log never frees is freed at the end.
struct Event {
    bool alloc;
    size_t size;
    long id;
};

bool read_log(const char *path, std::vector<Event> &ev, long &nalloc)
{
    FILE *f = std::fopen(path, "r");
    if (!f) return false;
    struct Line {
        unsigned long long order;
        bool alloc;
        unsigned long long ptr;
        size_t size;
    };
    std::vector<Line> lines;
    char line[512];
    while (std::fgets(line, sizeof line, f)) {
        unsigned long long order, ptr;
        long long t;
        int tid;
        void *stream;
        char op[16], status[48];
        size_t size;
        if (line[0] == '#' || std::sscanf(line, "%llu,%lld,%d,%p,%15[a-z],0x%llx,%zu,%47s", &order, &t, &tid,
                                          &stream, op, &ptr, &size, status) != 8)
            continue;
        if (std::string(status) != "CUBUF_SUCCESS" || size == 0) continue;
        lines.push_back({order, op[0] == 'a', ptr, size});
    }
    std::fclose(f);
    /* Lines of different threads may come out of order (cubuf/adaptor.h). */
    std::stable_sort(lines.begin(), lines.end(), [](const Line &a, const Line &b) { return a.order < b.order; });
    std::unordered_map<unsigned long long, std::pair<long, size_t>> live;
    nalloc = 0;
    for (const Line &l : lines) {
        if (l.alloc) {
            live[l.ptr] = {nalloc, l.size};
            ev.push_back({true, l.size, nalloc++});
        } else {
            auto it = live.find(l.ptr);
            if (it == live.end()) continue; /* allocated before the log began */
            ev.push_back({false, it->second.second, it->second.first});
            live.erase(it);
        }
    }
    for (auto &l : live) ev.push_back({false, l.second.second, l.second.first});
    return true;
}

// Nanoseconds per operation of one replay of the events by `side` on `s`.
double replay(Side side, const std::vector<Event> &ev, long nalloc, CUstream s)
{
    std::vector<void *> p(size_t(nalloc), nullptr);
    DRV(drv.stream_sync(s));
    double t0 = now();
    for (const Event &e : ev) {
        if (e.alloc) {
            if (side == TORCH) p[e.id] = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(e.size, s);
            else if (side == CUBUF) p[e.id] = cubuf_torch_alloc(e.size, 0, s);
            else {
                CUdeviceptr d = 0;
                DRV(drv.alloc_from_pool(&d, e.size, g_pool, s));
                p[e.id] = reinterpret_cast<void *>(d);
            }
            if (!p[e.id]) die("replay allocation", int(side));
        } else if (side == TORCH) {
            c10::cuda::CUDACachingAllocator::raw_delete(p[e.id]);
        } else if (side == CUBUF) {
            cubuf_torch_free(p[e.id], e.size, 0, s);
        } else {
            DRV(drv.free_async(reinterpret_cast<CUdeviceptr>(p[e.id]), s));
        }
    }
    DRV(drv.stream_sync(s));
    return (now() - t0) / double(ev.size()) * 1e9;
}

}  // namespace

int main(int argc, char **argv)
{
    const char *path = std::getenv("CUBUF_LIBCUDA"); // the driver cubuf loads too
    void *lib = dlopen(path ? path : "libcuda.so.1", RTLD_NOW);
    if (!lib) {
        std::printf("bench_torch_peer: no CUDA driver here (%s)\n", dlerror());
        return 77;
    }
    get_proc = reinterpret_cast<decltype(get_proc)>(dlsym(lib, "cuGetProcAddress_v2"));
    if (!get_proc) die("dlsym(cuGetProcAddress_v2)", -1);
    sym("cuInit", drv.init);
    sym("cuDeviceGet", drv.device_get);
    sym("cuDevicePrimaryCtxRetain", drv.primary_retain);
    sym("cuCtxSetCurrent", drv.ctx_set);
    sym("cuStreamCreate", drv.stream_create);
    sym("cuStreamSynchronize", drv.stream_sync);
    sym("cuMemPoolCreate", drv.pool_create);
    sym("cuMemPoolSetAttribute", drv.pool_set);
    sym("cuMemAllocFromPoolAsync", drv.alloc_from_pool);
    sym("cuMemFreeAsync", drv.free_async);
    DRV(drv.init(0));
    CUdevice dev;
    DRV(drv.device_get(&dev, 0));
    DRV(drv.primary_retain(&g_ctx, dev));
    DRV(drv.ctx_set(g_ctx));
    c10::cuda::CUDACachingAllocator::init(1);
    CUmemPoolProps props{};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    DRV(drv.pool_create(&g_pool, &props));
    cuuint64_t keep = UINT64_MAX;
    DRV(drv.pool_set(g_pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep));
    std::vector<CUstream> streams(8);
    for (auto &s : streams) DRV(drv.stream_create(&s, CU_STREAM_NON_BLOCKING));

    std::printf("bench_torch_peer: ns per allocate + free on one stream (median of 21 batches)\n");
    std::printf("%8s | %10s %10s %10s | %12s %12s %12s\n", "size", "pytorch", "cubuf", "raw pool",
                "cubuf/torch", "cubuf/pool", "torch/pool");
    const size_t sizes[] = {256, 4096, 64u << 10, 1u << 20, 64u << 20};
    const char *labels[] = {"256 B", "4 KiB", "64 KiB", "1 MiB", "64 MiB"};
    int pass = 0, targets = 0;
    char lines[8][160];
    for (int i = 0; i < 5; i++) {
        double ns[3];
        one_stream(sizes[i], streams[0], ns);
        std::printf("%8s | %10.1f %10.1f %10.1f | %12.3f %12.3f %12.3f\n", labels[i], ns[TORCH],
                    ns[CUBUF], ns[RAW], ns[CUBUF] / ns[TORCH], ns[CUBUF] / ns[RAW],
                    ns[TORCH] / ns[RAW]);
        if (sizes[i] <= (1u << 20)) {
            bool ok = ns[CUBUF] / ns[TORCH] <= 0.25;
            pass += ok;
            std::snprintf(lines[targets++], sizeof lines[0],
                          "TARGET torch_peer/cubuf_vs_pytorch/%s: ratio %.3f (target <= 0.25) %s",
                          labels[i], ns[CUBUF] / ns[TORCH], ok ? "PASS" : "MISS");
        }
        std::fflush(stdout);
    }
    for (int r = 0; r < 2; r++) {
        bool random = r == 1;
        std::printf("\n%s, each thread on its own stream: allocate + free per second\n",
                    random ? "random sizes 256 B - 1 MiB" : "4 KiB");
        std::printf("%9s | %14s %14s | %8s\n", "side", "1 thread", "8 threads", "scaling");
        double at8[3];
        for (int w = 0; w < 3; w++) {
            throughput(Side(w), 8, random, streams);  // warm
            double one = throughput(Side(w), 1, random, streams);
            at8[w] = throughput(Side(w), 8, random, streams);
            std::printf("%9s | %14.0f %14.0f | %7.2fx\n", k_names[w], one, at8[w], at8[w] / one);
        }
        std::printf("8 threads: cubuf/pytorch throughput %.2fx, cubuf/raw %.2fx, pytorch/raw %.2fx\n",
                    at8[CUBUF] / at8[TORCH], at8[CUBUF] / at8[RAW], at8[TORCH] / at8[RAW]);
        std::fflush(stdout);
    }
    if (argc > 1) {
        std::vector<Event> ev;
        long nalloc = 0;
        if (!read_log(argv[1], ev, nalloc)) die("reading the log", 0);
        std::printf("\nreplay of %s: %zu events (%ld allocations), in order on one stream; ns per "
                    "operation, median of 7 rounds\n", argv[1], ev.size(), nalloc);
        std::vector<double> t[3];
        for (int w = 0; w < 3; w++) replay(Side(w), ev, nalloc, streams[0]); /* warm */
        for (int r = 0; r < 7; r++)
            for (int k = 0; k < 3; k++) {
                int w = (k + r) % 3;
                t[w].push_back(replay(Side(w), ev, nalloc, streams[0]));
            }
        double med[3];
        for (int w = 0; w < 3; w++) {
            std::sort(t[w].begin(), t[w].end());
            med[w] = t[w][t[w].size() / 2];
        }
        std::printf("%10s %10s %10s | %12s %12s\n", "pytorch", "cubuf", "raw pool", "cubuf/torch", "cubuf/pool");
        std::printf("%10.1f %10.1f %10.1f | %12.3f %12.3f\n", med[TORCH], med[CUBUF], med[RAW],
                    med[CUBUF] / med[TORCH], med[CUBUF] / med[RAW]);
        const char *who[2] = {"pytorch", "raw_pool"};
        const double vs[2] = {med[TORCH], med[RAW]};
        for (int i = 0; i < 2; i++) {
            bool ok = med[CUBUF] < vs[i];
            pass += ok;
            std::snprintf(lines[targets++], sizeof lines[0],
                          "TARGET torch_peer/replay_cubuf_vs_%s: ratio %.3f (target < 1.00) %s", who[i],
                          med[CUBUF] / vs[i], ok ? "PASS" : "MISS");
        }
    }
    std::printf("\n== bench_torch_peer summary\n");
    for (int i = 0; i < targets; i++) std::printf("%s\n", lines[i]);
    std::printf("bench_torch_peer: %d of %d targets met\n", pass, targets);
    for (auto &s : streams) {
        cubuf_resource_t *fw = nullptr;
        if (cubuf_framework_resource(0, &fw) == CUBUF_SUCCESS) (void)cubuf_caching_forget_stream(fw, s);
    }
    return 0;
}
