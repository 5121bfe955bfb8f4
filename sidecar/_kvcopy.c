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

static PyMethodDef methods[] = {
    {"run_plan", run_plan, METH_VARARGS,
     "run_plan(plan, stream_min, /): copy each (dst, src, nbytes) run of a list with the GIL "
     "released, non-temporal stores for a plan of stream_min bytes or more; the bytes moved."},
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
