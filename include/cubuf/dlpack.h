/*
 * cubuf DLPack: a buffer handed to another library (PyTorch, CuPy, JAX,
 * Numba, any DLPack consumer) without a copy, and a DLPack tensor of another
 * library taken in as a cubuf buffer. Not included by <cubuf.h>: include
 * <cubuf/dlpack.h> where you exchange tensors. The general rules at the top
 * of <cubuf.h> hold here too.
 *
 * The DLPack ABI. The first part of this header declares the C types and
 * constants of the DLPack specification, version 1.2 (the tensor exchange:
 * DLPackVersion, DLDevice, DLDataType, DLTensor, DLManagedTensor and
 * DLManagedTensorVersioned; not the function tables of the Python
 * "exchange API"), written for cubuf from the specification
 * (https://dmlc.github.io/dlpack/latest/c_api.html), because the systems
 * cubuf builds on ship DLPack headers older than 1.0, which lack the
 * versioned tensor. The declarations sit behind the include guard of the
 * specification's own header, DLPACK_DLPACK_H_, so a program gets one
 * definition of each type whichever it includes:
 *  - <dlpack/dlpack.h> (1.0 or newer) before this header: its declarations
 *    are used and these are skipped; the layouts are the same ABI;
 *  - this header first: the later <dlpack/dlpack.h> is skipped entirely
 *    (include it first if you need what it has beyond the above);
 *  - a <dlpack/dlpack.h> older than 1.0 first: compiling stops with an
 *    #error, since it has no DLManagedTensorVersioned.
 *
 * Who owns what. An exported tensor (cubuf_buffer_to_dlpack) belongs to the
 * consumer, which calls its deleter exactly once, from any thread, when it
 * no longer needs the memory; until then the tensor keeps the memory alive
 * through a slice of the buffer (see cubuf_buffer_slice): the buffer it came
 * from cannot be closed (CUBUF_ERROR_BUSY) and releasing the caller's last
 * handle leaves the memory to the tensor. An imported tensor
 * (cubuf_buffer_from_dlpack) belongs to the new buffer, which calls the
 * producer's deleter once, when the buffer is closed or its last reference
 * released, on the thread that does that.
 *
 * Streams. DLPack itself carries no stream. Neither direction synchronizes
 * anything: the memory is handed over as it is, and the exchanging code
 * orders the consumer's work after the producer's (the Python array API's
 * `stream` argument of __dlpack__ is how Python consumers ask for that).
 */
#ifndef CUBUF_DLPACK_H
#define CUBUF_DLPACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cubuf.h>

/* ------------------------------------------------------------------------ */
/* The DLPack ABI (specification 1.2)                                        */
/* ------------------------------------------------------------------------ */

#ifndef DLPACK_DLPACK_H_
#define DLPACK_DLPACK_H_

#ifdef __cplusplus
#define DLPACK_EXTERN_C extern "C"
#else
#define DLPACK_EXTERN_C
#endif
#define DLPACK_DLL

/** The version of the layouts below. A new major version changes the
 *  layout of DLManagedTensorVersioned; a new minor one only adds enum values. */
#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 2

#ifdef __cplusplus
extern "C" {
#endif

/** The version a versioned tensor was made with. A consumer reads nothing
 *  of a tensor whose major version it does not know but the deleter. */
typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

/** Where the memory of a tensor lives. 4 bytes in C and in C++. */
#ifdef __cplusplus
typedef enum : int32_t {
#else
typedef enum {
#endif
    kDLCPU = 1,          /**< host memory (pageable) */
    kDLCUDA = 2,         /**< CUDA device memory */
    kDLCUDAHost = 3,     /**< pinned host memory, reachable from CUDA devices */
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,          /**< Verilog simulator */
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,      /**< reserved for testing extensions */
    kDLCUDAManaged = 13, /**< CUDA managed (unified) memory */
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17,
    kDLTrn = 18,         /**< AWS Trainium (1.2) */
} DLDeviceType;

/** A device: its type and index. The index is 0 for host, pinned and managed memory. */
typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

/** The kinds of element (the `code` of DLDataType). */
typedef enum {
    kDLInt = 0U,
    kDLUInt = 1U,
    kDLFloat = 2U,
    kDLOpaqueHandle = 3U,
    kDLBfloat = 4U,
    kDLComplex = 5U,  /**< two floats of bits/2 each, real first */
    kDLBool = 6U,     /**< stored in 8 bits by convention */
    kDLFloat8_e3m4 = 7U,
    kDLFloat8_e4m3 = 8U,
    kDLFloat8_e4m3b11fnuz = 9U,
    kDLFloat8_e4m3fn = 10U,
    kDLFloat8_e4m3fnuz = 11U,
    kDLFloat8_e5m2 = 12U,
    kDLFloat8_e5m2fnuz = 13U,
    kDLFloat8_e8m0fnu = 14U,
    kDLFloat6_e2m3fn = 15U, /**< bits 6, packed */
    kDLFloat6_e3m2fn = 16U, /**< bits 6, packed */
    kDLFloat4_e2m1fn = 17U, /**< bits 4, packed */
} DLDataTypeCode;

/** An element type in native byte order: `lanes` values of `bits` bits
 *  of kind `code` (a DLDataTypeCode). float32 is {kDLFloat, 32, 1}. */
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

/**
 * A strided array that owns nothing. Element (i_0, ..., i_{ndim-1}) lies at
 * (char *)data + byte_offset + (sum_k i_k * strides[k]) * (bits * lanes / 8):
 * strides count elements, not bytes, and may be negative or 0. strides is
 * never NULL when ndim > 0 in tensors made since 1.2 (earlier producers
 * could pass NULL for a C-contiguous array). An empty tensor may have data
 * NULL.
 */
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;   /**< ndim extents */
    int64_t *strides; /**< ndim strides, in elements */
    uint64_t byte_offset;
} DLTensor;

/** The unversioned managed tensor (Python capsule "dltensor"), kept for
 *  consumers older than DLPack 1.0. deleter(self) (may be NULL) frees it
 *  and what manager_ctx holds. */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/** flags: the consumer must not write through the tensor. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)
/** flags: the tensor is the producer's copy, the consumer's alone until the deleter runs. */
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)
/** flags (1.1): a sub-byte element type is stored padded, one per byte, not packed. */
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (UINT64_C(1) << 2)

/** The versioned managed tensor of DLPack 1.x (Python capsule
 *  "dltensor_versioned"). Everything up to flags keeps its place in every
 *  future version, so the deleter can always be called. */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags; /**< DLPACK_FLAG_BITMASK_* */
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}
#endif

#endif /* DLPACK_DLPACK_H_ */

#if !defined(DLPACK_MAJOR_VERSION) || DLPACK_MAJOR_VERSION != 1
#error "<cubuf/dlpack.h> needs DLPack 1.x: an older <dlpack/dlpack.h> was included before it"
#endif

#if UINTPTR_MAX == UINT64_MAX
#ifdef __cplusplus
static_assert(sizeof(DLManagedTensorVersioned) == 80, "80 bytes on LP64");
static_assert(sizeof(DLManagedTensor) == 64, "64 bytes on LP64");
#else
_Static_assert(sizeof(DLManagedTensorVersioned) == 80, "80 bytes on LP64");
_Static_assert(sizeof(DLManagedTensor) == 64, "64 bytes on LP64");
#endif
#endif

/* ------------------------------------------------------------------------ */
/* Export and import                                                         */
/* ------------------------------------------------------------------------ */

#ifdef __cplusplus
extern "C" {
#endif

/**
 * How cubuf_buffer_to_dlpack describes a buffer. Initialize with
 * CUBUF_DLPACK_OPTIONS_INIT (the struct_size rule of <cubuf.h> applies).
 *  - dtype: the element type (default uint8, {kDLUInt, 8, 1}). bits must be
 *    a positive multiple of 8 (sub-byte types are not supported), lanes > 0;
 *    an element is bits / 8 * lanes bytes (its itemsize). The code is passed
 *    on as given.
 *  - ndim 0 (the default): a 1-D tensor of size / itemsize elements (the
 *    buffer's size must be a multiple of the itemsize); shape and strides
 *    are ignored. ndim > 0: `shape` holds ndim extents (>= 0).
 *  - strides: ndim strides in elements (negative and 0 allowed), or NULL
 *    for C-contiguous (row-major) strides. The tensor always carries
 *    strides.
 *  - read_only: set DLPACK_FLAG_BITMASK_READ_ONLY (versioned tensors only).
 * shape and strides are read during the call only (the tensor holds copies).
 */
typedef struct cubuf_dlpack_options {
    size_t struct_size;
    DLDataType dtype;
    int32_t ndim;
    const int64_t *shape;
    const int64_t *strides;
    bool read_only;
} cubuf_dlpack_options_t;

#define CUBUF_DLPACK_OPTIONS_INIT \
    {sizeof(cubuf_dlpack_options_t), {kDLUInt, 8, 1}, 0, NULL, NULL, false}

/** Size of the first released layout (cubuf 0.1, up to read_only). */
#define CUBUF_DLPACK_OPTIONS_SIZE_V1 (offsetof(cubuf_dlpack_options_t, read_only) + sizeof(bool))

/**
 * Exports `buf` as a versioned DLPack tensor (version DLPACK_MAJOR_VERSION.
 * DLPACK_MINOR_VERSION, flags 0 or READ_ONLY) without copying: what a
 * Python __dlpack__ returns in its "dltensor_versioned" capsule.
 * `opts` (NULL: the defaults, a 1-D uint8 tensor of the buffer's bytes)
 * gives the element type and layout. The tensor's elements lie inside the
 * buffer: the lowest byte any element reaches (given its shape and
 * strides) is the buffer's first byte, so data is the buffer's pointer when
 * no stride is negative (byte_offset is always 0); a tensor without
 * elements has data NULL. The device is what cubuf_buffer_dlpack_device
 * returns. shape and strides point into the tensor's own allocation.
 * The tensor holds a slice of the whole buffer (cubuf_buffer_slice) until
 * its deleter runs: while it lives, the buffer (the root, for a slice)
 * cannot be closed (CUBUF_ERROR_BUSY), and releasing the caller's handle
 * leaves the memory allocated until the deleter drops it. The deleter may
 * run on any thread; when it drops the memory's last reference the memory
 * is freed there on the buffer's recorded deallocation stream (see
 * cubuf_buffer_slice for what that asks of the stream). *out (written on
 * success only) belongs to the consumer, which calls (*out)->deleter(*out)
 * exactly once.
 * No driver call is made.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (buf or out NULL; opts->struct_size
 * below CUBUF_DLPACK_OPTIONS_SIZE_V1; a dtype with bits 0, lanes 0 or bits
 * not a multiple of 8; ndim < 0; shape NULL with ndim > 0; a negative
 * extent; with ndim 0, a buffer size that is not a multiple of the
 * itemsize), CUBUF_ERROR_CLOSED (buf is closed), CUBUF_ERROR_OUT_OF_RANGE
 * (the elements reach more bytes than the buffer holds, or the layout's
 * arithmetic overflows 64 bits, or with ndim 0 the buffer holds more
 * elements than an int64 extent counts; the detail names the sizes),
 * CUBUF_ERROR_NOT_SUPPORTED (as cubuf_buffer_dlpack_device),
 * CUBUF_ERROR_OUT_OF_MEMORY.
 * Thread-safety: several threads may export one buffer at once; exporting
 * while another thread closes it is the caller's race.
 */
CUBUF_API cubuf_status_t cubuf_buffer_to_dlpack(cubuf_buffer_t *buf,
                                                const cubuf_dlpack_options_t *opts,
                                                DLManagedTensorVersioned **out);

/**
 * The same as an unversioned DLManagedTensor (a "dltensor" capsule), for
 * consumers that do not ask for DLPack 1.x. It has no flags: opts->read_only
 * gives CUBUF_ERROR_NOT_SUPPORTED. Otherwise as cubuf_buffer_to_dlpack,
 * statuses included.
 */
CUBUF_API cubuf_status_t cubuf_buffer_to_dlpack_unversioned(cubuf_buffer_t *buf,
                                                            const cubuf_dlpack_options_t *opts,
                                                            DLManagedTensor **out);

/**
 * Imports a versioned DLPack tensor as a buffer, without copying: the buffer
 * spans the tensor's enclosing byte range, from the lowest to the end of the
 * highest byte any element reaches, element 0 lying at data + byte_offset
 * (strides NULL means C-contiguous; a tensor without elements gives a
 * buffer of size 0 at data + byte_offset, or at 0 when data is NULL). The
 * buffer is made as by cubuf_buffer_wrap_external, so its device and its
 * accessibility come from the driver (memory it does not know is pageable
 * host memory); the tensor's device type must be kDLCUDA, kDLCUDAManaged,
 * kDLCUDAHost or kDLCPU. The tensor's read-only flag is kept
 * (cubuf_dlpack_is_read_only); its element type only sizes the elements.
 * On success the buffer owns `t`: it calls t->deleter(t) (unless NULL)
 * exactly once, when the buffer is closed or its last reference released,
 * on that thread; the caller releases the buffer. On failure nothing is
 * called and the caller still owns `t` (a consumer then calls the deleter
 * itself, as DLPack asks for tensors it cannot use).
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (t or out NULL; ndim < 0; shape NULL
 * with ndim > 0; a negative extent; a dtype with bits 0, lanes 0 or bits
 * not a multiple of 8; data NULL with elements), CUBUF_ERROR_NOT_SUPPORTED
 * (a major version other than 1, whose fields must not be read; another
 * device type, named in the detail), CUBUF_ERROR_OUT_OF_RANGE (the range's
 * arithmetic overflows 64 bits, or the range starts at or below address 0
 * or passes the end of the address space), CUBUF_ERROR_NO_DRIVER (the
 * driver describes every range at an address other than 0, kDLCPU memory
 * too), CUBUF_ERROR_OUT_OF_MEMORY, CUBUF_ERROR_DRIVER.
 * Thread-safety: any thread; one tensor is imported once.
 */
CUBUF_API cubuf_status_t cubuf_buffer_from_dlpack(DLManagedTensorVersioned *t,
                                                  cubuf_buffer_t **out);

/**
 * The same for an unversioned DLManagedTensor (no version to check, no
 * flags: never read-only). Otherwise as cubuf_buffer_from_dlpack, statuses
 * included.
 */
CUBUF_API cubuf_status_t cubuf_buffer_from_dlpack_unversioned(DLManagedTensor *t,
                                                              cubuf_buffer_t **out);

/**
 * Whether `buf`'s memory came from a versioned DLPack tensor flagged
 * DLPACK_FLAG_BITMASK_READ_ONLY (a buffer from cubuf_buffer_from_dlpack, or
 * a slice or based view of one). cubuf does not enforce the flag: copies
 * and fills into the buffer are not refused, and cubuf_buffer_to_dlpack
 * sets the flag only when opts->read_only asks (pass this function's
 * answer there to pass the producer's wish on). false for NULL, a closed
 * buffer and every other buffer. Never fails; as thread-safe as reading
 * any attribute of the buffer.
 */
CUBUF_API bool cubuf_dlpack_is_read_only(const cubuf_buffer_t *buf);

/**
 * The DLPack device of `buf` (what a Python __dlpack_device__ returns):
 *  - managed memory: kDLCUDAManaged, device_id 0;
 *  - pinned host memory (host and device accessible, not managed; the
 *    pinned and legacy pinned resources): kDLCUDAHost, device_id 0;
 *  - device memory (device accessible only; IPC imports included): kDLCUDA,
 *    device_id the buffer's device (cubuf_buffer_device_id);
 *  - host memory only (pageable host memory, host-only user resources) and
 *    memory accessible from nowhere (an empty view at address 0): kDLCPU,
 *    device_id 0.
 * *device_type receives a DLDeviceType value. Both outputs are written on
 * success only. No driver call is made. Thread-safe.
 * Returns CUBUF_ERROR_INVALID_ARGUMENT (a NULL argument), CUBUF_ERROR_CLOSED,
 * CUBUF_ERROR_NOT_SUPPORTED (device memory bound to no device, device_id
 * -1: a user resource's, which DLPack cannot name).
 */
CUBUF_API cubuf_status_t cubuf_buffer_dlpack_device(const cubuf_buffer_t *buf, int32_t *device_type,
                                                    int32_t *device_id);

#ifdef __cplusplus
}
#endif

#endif /* CUBUF_DLPACK_H */
