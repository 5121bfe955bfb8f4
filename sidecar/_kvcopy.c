/* A copy plan's runs (sidecar/transports/shm.py, buffers mapped in the sidecar), copied
 * with the GIL released. Optional: built at install when a C compiler is there
 * (setup.py); shm.py copies the same runs with ctypes.memmove otherwise.
 *
 *   run_plan(plan, stream_min) -> bytes moved
 *       plan: a list of (dst address, src address, nbytes) tuples, as build_plan makes them
 *
 * A plan of `stream_min` bytes or more is copied with non-temporal stores (x86 SSE2):
 * the destination is written without being read into the cache first, so a large restore
 * moves about two thirds of the memory traffic of memmove's cached stores (glibc streams
 * only copies above its own threshold, 3/4 of the L3 cache and up, never a 64 KiB run of
 * one layer of one block). Runs that overlap, or are short, go through memmove. Addresses
 * are trusted: the caller built them inside its own mappings (sidecar/transports/base.py).
 *
 *   cuda_plan(plan, stream, batch, abi, each, order) -> (bytes, CUresult, failed run or -1)
 *
 * The same plan for the CUDA transport (sidecar/transports/cuda_ipc.py): its runs handed to
 * the driver on `stream` with the GIL released, as one cuMemcpyBatchAsync (`batch`, a
 * function pointer from cuGetProcAddress; `abi` 13000 or 12080, whose signature differs by
 * the failIdx argument) with every run's source read in `order` (1: stream order), or,
 * where the driver has no batch call (`batch` 0), as a loop of cuMemcpyAsync (`each`) here:
 * no Python work per run either way. Copy engines only: no kernel is launched. No CUDA
 * header or library is needed to build this file: the pointers come from the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define STREAM_RUN 256 /* shorter runs: memmove */

typedef struct {
    char *dst;
    const char *src;
    size_t n;
} Run;

#if defined(__SSE2__)
static void
stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#endif

static void
copy_runs(const Run *runs, Py_ssize_t count, int stream)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        const Run *r = &runs[i];
#if defined(__SSE2__)
        if (stream && r->n >= STREAM_RUN
            && (r->dst + r->n <= r->src || r->src + r->n <= r->dst)) {
            stream_copy(r->dst, r->src, r->n);
            continue;
        }
#endif
        memmove(r->dst, r->src, r->n);
    }
#if defined(__SSE2__)
    if (stream)
        _mm_sfence(); /* the streamed bytes are visible before the copy reports its end */
#endif
}

static int
parse_run(PyObject *item, Run *r)
{
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_TypeError, "each run must be a (dst, src, nbytes) tuple");
        return -1;
    }
    unsigned long long dst = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 0));
    unsigned long long src = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 1));
    size_t n = PyLong_AsSize_t(PyTuple_GET_ITEM(item, 2));
    if (PyErr_Occurred())
        return -1;
    r->dst = (char *)(uintptr_t)dst;
    r->src = (const char *)(uintptr_t)src;
    r->n = n;
    return 0;
}

static PyObject *
run_plan(PyObject *self, PyObject *args)
{
    PyObject *plan;
    unsigned long long stream_min;
    if (!PyArg_ParseTuple(args, "O!K:run_plan", &PyList_Type, &plan, &stream_min))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(plan);
    Run *runs = PyMem_RawMalloc(count ? (size_t)count * sizeof(Run) : 1);
    if (runs == NULL)
        return PyErr_NoMemory();
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (parse_run(PyList_GET_ITEM(plan, i), &runs[i]) < 0) {
            PyMem_RawFree(runs);
            return NULL;
        }
        total += runs[i].n;
    }
    int stream = total >= stream_min;
    Py_BEGIN_ALLOW_THREADS
    copy_runs(runs, count, stream);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(runs);
    return PyLong_FromUnsignedLongLong(total);
}

/* The driver's types, as cuda.h declares them (CUdeviceptr is 64 bits, CUresult an enum). */
typedef unsigned long long DevPtr;
typedef struct {
    int type; /* CUmemLocationType: 0, invalid (no hint) */
    int id;
} MemLocation;
typedef struct {
    int src_access_order; /* CUmemcpySrcAccessOrder */
    MemLocation src_loc_hint;
    MemLocation dst_loc_hint;
    unsigned int flags;
} MemcpyAttributes;
typedef int (*memcpy_async_fn)(DevPtr, DevPtr, size_t, void *);
typedef int (*batch_v12080_fn)(DevPtr *, DevPtr *, size_t *, size_t, MemcpyAttributes *,
                               size_t *, size_t, size_t *, void *);
typedef int (*batch_v13000_fn)(DevPtr *, DevPtr *, size_t *, size_t, MemcpyAttributes *,
                               size_t *, size_t, void *);

typedef struct {
    DevPtr *dsts, *srcs;
    size_t *sizes;
    Py_ssize_t count;
} Runs;

/* The driver calls of one plan, without the GIL: the CUresult, and in *failed the run
 * that failed (-1: none, or not one run's fault). */
static int
submit_runs(const Runs *r, void *stream, unsigned long long batch, int abi,
            unsigned long long each, int order, Py_ssize_t *failed)
{
    *failed = -1;
    if (batch) {
        MemcpyAttributes attr;
        memset(&attr, 0, sizeof attr);
        attr.src_access_order = order;
        size_t first = 0, fail_idx = (size_t)-1;
        int err;
        if (abi >= 13000)
            err = ((batch_v13000_fn)(uintptr_t)batch)(r->dsts, r->srcs, r->sizes,
                                                     (size_t)r->count, &attr, &first, 1, stream);
        else
            err = ((batch_v12080_fn)(uintptr_t)batch)(r->dsts, r->srcs, r->sizes,
                                                     (size_t)r->count, &attr, &first, 1,
                                                     &fail_idx, stream);
        if (err && fail_idx < (size_t)r->count)
            *failed = (Py_ssize_t)fail_idx;
        return err;
    }
    memcpy_async_fn one = (memcpy_async_fn)(uintptr_t)each;
    for (Py_ssize_t i = 0; i < r->count; i++) {
        int err = one(r->dsts[i], r->srcs[i], r->sizes[i], stream);
        if (err) {
            *failed = i;
            return err;
        }
    }
    return 0;
}

static PyObject *
cuda_plan(PyObject *self, PyObject *args)
{
    PyObject *plan;
    unsigned long long stream, batch, each;
    int abi, order;
    if (!PyArg_ParseTuple(args, "O!KKiKi:cuda_plan", &PyList_Type, &plan, &stream, &batch,
                          &abi, &each, &order))
        return NULL;
    if (!batch && !each) {
        PyErr_SetString(PyExc_ValueError, "cuda_plan needs a batch or a per-run function");
        return NULL;
    }
    Runs r;
    r.count = PyList_GET_SIZE(plan);
    size_t n = r.count ? (size_t)r.count : 1;
    r.dsts = PyMem_RawMalloc(n * sizeof(DevPtr));
    r.srcs = PyMem_RawMalloc(n * sizeof(DevPtr));
    r.sizes = PyMem_RawMalloc(n * sizeof(size_t));
    PyObject *out = NULL;
    if (r.dsts == NULL || r.srcs == NULL || r.sizes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < r.count; i++) {
        Run run;
        if (parse_run(PyList_GET_ITEM(plan, i), &run) < 0)
            goto done;
        r.dsts[i] = (DevPtr)(uintptr_t)run.dst;
        r.srcs[i] = (DevPtr)(uintptr_t)run.src;
        r.sizes[i] = run.n;
        total += run.n;
    }
    int err = 0;
    Py_ssize_t failed = -1;
    if (r.count) {
        Py_BEGIN_ALLOW_THREADS
        err = submit_runs(&r, (void *)(uintptr_t)stream, batch, abi, each, order, &failed);
        Py_END_ALLOW_THREADS
    }
    out = Py_BuildValue("(Kin)", total, err, failed);
done:
    PyMem_RawFree(r.dsts);
    PyMem_RawFree(r.srcs);
    PyMem_RawFree(r.sizes);
    return out;
}

static PyMethodDef methods[] = {
    {"run_plan", run_plan, METH_VARARGS,
     "run_plan(plan, stream_min, /): copy each (dst, src, nbytes) run of a list with the GIL "
     "released, non-temporal stores for a plan of stream_min bytes or more; the bytes moved."},
    {"cuda_plan", cuda_plan, METH_VARARGS,
     "cuda_plan(plan, stream, batch, abi, each, order, /): hand each (dst, src, nbytes) run to "
     "the CUDA driver on stream, as one batch call or a loop of per-run calls, with the GIL "
     "released; (bytes, CUresult, index of the failed run or -1)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kvcopy", "A copy plan's runs without the GIL (see _kvcopy.c).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__kvcopy(void)
{
    return PyModule_Create(&module);
}
