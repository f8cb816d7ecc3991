/* Loading libcuda at run time and resolving the call table. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

cubuf_driver_t cubuf__drv;

static const char *const drv_names[] = {
#define CUBUF_DRV_NAME_(name, version) #name,
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_NAME_, CUBUF_DRV_NAME_)
#undef CUBUF_DRV_NAME_
};

const char *cubuf__drv_name(cubuf_drv_id_t id)
{
    return (unsigned)id < CUBUF_DRV_COUNT ? drv_names[id] : "?";
}

/* Each entry's version; required ones positive, optional ones negative. */
static const int drv_versions[] = {
#define CUBUF_DRV_REQ_V_(name, version) version,
#define CUBUF_DRV_OPT_V_(name, version) -(version),
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_REQ_V_, CUBUF_DRV_OPT_V_)
#undef CUBUF_DRV_REQ_V_
#undef CUBUF_DRV_OPT_V_
};

int cubuf__driver_floor(const char **entry)
{
    int floor = 0, at = 0;
    for (int i = 0; i < CUBUF_DRV_COUNT; i++)
        if (drv_versions[i] > floor) floor = drv_versions[at = i];
    if (entry) *entry = drv_names[at];
    return floor;
}

int cubuf_driver_min_version(void) { return cubuf__driver_floor(NULL); }

cubuf_status_t cubuf__drv_absent(cubuf_drv_id_t id)
{
    int v = cubuf__drv.version, need = -drv_versions[id];
    return cubuf__fail(CUBUF_ERROR_NOT_SUPPORTED,
                       "%s is not available: it needs a CUDA %d.%d driver, this one is %d.%d",
                       cubuf__drv_name(id), need / 1000, need % 1000 / 10, v / 1000,
                       v % 1000 / 10);
}

cubuf_drv_id_t cubuf__drv_lookup(const char *name)
{
    for (int i = 0; i < CUBUF_DRV_COUNT; i++)
        if (strcmp(drv_names[i], name) == 0) return (cubuf_drv_id_t)i;
    return CUBUF_DRV_COUNT;
}

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static cubuf_status_t load_status;
static char load_detail[512];

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t,
                                CUdriverProcAddressQueryResult *);

static cubuf_status_t resolve(get_proc_fn get_proc, int driver_version, const char *name,
                              int version, void **slot, bool required)
{
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult r = CUDA_ERROR_NOT_FOUND;
    /* An older driver would answer with the newest variant it has, whose
     * signature may differ from the one asked for: such an entry is absent. */
    if (version <= driver_version)
        r = get_proc(name, slot, version, CU_GET_PROC_ADDRESS_DEFAULT, &q);
    if (r == CUDA_SUCCESS && q == CU_GET_PROC_ADDRESS_SUCCESS && *slot) return CUBUF_SUCCESS;
    *slot = NULL;
    if (!required) return CUBUF_SUCCESS;
    snprintf(load_detail, sizeof load_detail,
             "the CUDA driver lacks %s (ABI of CUDA %d; CUresult %d, query result %d)", name,
             version, (int)r, (int)q);
    return CUBUF_ERROR_NO_DRIVER;
}

static void load(void)
{
    const char *path = getenv("CUBUF_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(load_detail, sizeof load_detail, "cannot load the CUDA driver library %s: %s",
                 path, why ? why : "unknown reason");
        load_status = CUBUF_ERROR_NO_DRIVER;
        return;
    }
    get_proc_fn get_proc = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    if (!get_proc) {
        snprintf(load_detail, sizeof load_detail,
                 "%s has no cuGetProcAddress_v2: driver older than CUDA 12.0", path);
        load_status = CUBUF_ERROR_NO_DRIVER;
        return; /* lib stays loaded: unloading a driver is never safe */
    }
    /* The driver's version first: it decides which entry points exist. */
    int version = 0;
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SUCCESS;
    if (get_proc("cuDriverGetVersion", (void **)&cubuf__drv.cuDriverGetVersion, 2020,
                 CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS ||
        !cubuf__drv.cuDriverGetVersion || cubuf__drv.cuDriverGetVersion(&version) != CUDA_SUCCESS)
        version = 0;
    const char *needs = NULL;
    const int floor = cubuf__driver_floor(&needs);
    if (version < floor) {
        snprintf(load_detail, sizeof load_detail,
                 "the CUDA driver %s is version %d.%d (%d); cubuf needs %d.%d (%d) or newer, for "
                 "%s", path, version / 1000, version % 1000 / 10, version, floor / 1000,
                 floor % 1000 / 10, floor, needs);
        load_status = CUBUF_ERROR_NO_DRIVER;
        return;
    }
    cubuf_status_t st = CUBUF_SUCCESS;
#define CUBUF_DRV_REQ_(name, v) \
    if (st == CUBUF_SUCCESS) st = resolve(get_proc, version, #name, v, (void **)&cubuf__drv.name, true);
#define CUBUF_DRV_OPT_(name, v) \
    if (st == CUBUF_SUCCESS) st = resolve(get_proc, version, #name, v, (void **)&cubuf__drv.name, false);
    CUBUF_DRIVER_ENTRIES(CUBUF_DRV_REQ_, CUBUF_DRV_OPT_)
#undef CUBUF_DRV_REQ_
#undef CUBUF_DRV_OPT_
    if (st != CUBUF_SUCCESS) {
        load_status = st;
        return;
    }
    cubuf__drv.version = version;
    CUresult r = cubuf__drv.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char *name = cubuf__cu_name(r);
        snprintf(load_detail, sizeof load_detail, "cuInit failed: %s", name ? name : "?");
        load_status = r == CUDA_ERROR_NO_DEVICE ? CUBUF_ERROR_NO_DEVICE : CUBUF_ERROR_NO_DRIVER;
        return;
    }
    load_status = CUBUF_SUCCESS;
}

cubuf_status_t cubuf__driver_load(void)
{
    pthread_once(&load_once, load);
    if (load_status != CUBUF_SUCCESS) return cubuf__fail(load_status, "%s", load_detail);
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf__cu_map(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS: return CUBUF_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: return CUBUF_ERROR_OUT_OF_MEMORY;
    case CUDA_ERROR_NO_DEVICE: return CUBUF_ERROR_NO_DEVICE;
    case CUDA_ERROR_NOT_SUPPORTED: return CUBUF_ERROR_NOT_SUPPORTED;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
    case CUDA_ERROR_CAPTURED_EVENT: return CUBUF_ERROR_STREAM_CAPTURING;
    default: return CUBUF_ERROR_DRIVER;
    }
}

const char *cubuf__cu_name(CUresult r)
{
    const char *name = NULL;
    if (!cubuf__drv.cuGetErrorName || cubuf__drv.cuGetErrorName(r, &name) != CUDA_SUCCESS) return NULL;
    return name;
}

cubuf_status_t cubuf__cu_status(CUresult r, const char *call)
{
    if (r == CUDA_SUCCESS) return CUBUF_SUCCESS;
    const char *name = cubuf__cu_name(r);
    cubuf__set_last_cu(r);
    if (name) return cubuf__fail(cubuf__cu_map(r), "%s failed: %s", call, name);
    return cubuf__fail(cubuf__cu_map(r), "%s failed: CUresult %d", call, (int)r);
}

int cubuf_version(void) { return CUBUF_VERSION; }

#define CUBUF_STR2_(x) #x
#define CUBUF_STR_(x) CUBUF_STR2_(x)
const char *cubuf_version_string(void)
{
    return CUBUF_STR_(CUBUF_VERSION_MAJOR) "." CUBUF_STR_(CUBUF_VERSION_MINOR) "." CUBUF_STR_(
        CUBUF_VERSION_PATCH);
}

cubuf_status_t cubuf_driver_version(int *version)
{
    CHECK_ARG(version, "cubuf_driver_version: version is NULL");
    cubuf_status_t st = cubuf__driver_load();
    /* A driver without a device still has a version to report. */
    if (st == CUBUF_ERROR_NO_DEVICE && cubuf__drv.version) st = CUBUF_SUCCESS;
    if (st == CUBUF_SUCCESS) *version = cubuf__drv.version;
    return st;
}
