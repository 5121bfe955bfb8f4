/* KV events' packer (sidecar/events.py): the two long arrays of a BlockStored or a
 * BlockRemoved written as msgpack straight from the set's Python lists, without a bytes
 * object a block hash or a flattened token list. Optional: built at install when a C
 * compiler is there (setup.py); events.py writes the same bytes in Python otherwise.
 *
 *   hex_array(keys, a, b)       keys[a:b], each an even number of hex digits (<= 510):
 *       array header | c4 LL <LL bytes of key a> | c4 LL <key a+1> | ...   (bin 8 items)
 *   flat_ints(lists, a, b)      the ints of lists[a], ..., lists[b-1], in order, as one array:
 *       array header | int | int | ...       (each int as msgpack's smallest form, as msgspec)
 *
 *   array header: 9x (n < 16) | dc nnnn (n < 2^16) | dd nnnnnnnn
 *
 * Either answers None where its input is not that (a key not hex, an item not an exact
 * int in int64, a bound out of range): the caller encodes those with msgspec. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static signed char HEX[256];

static unsigned char *
put_header(unsigned char *q, Py_ssize_t n)
{
    if (n < 16) {
        *q++ = 0x90 | (unsigned char)n;
    } else if (n < 65536) {
        *q++ = 0xdc; *q++ = (unsigned char)(n >> 8); *q++ = (unsigned char)n;
    } else {
        *q++ = 0xdd;
        for (int s = 24; s >= 0; s -= 8) *q++ = (unsigned char)(n >> s);
    }
    return q;
}

static unsigned char *
put_int(unsigned char *q, long long v)
{
    unsigned long long u = (unsigned long long)v;
    int bytes;
    if (v >= 0) {
        if (u < 128) { *q++ = (unsigned char)u; return q; }
        if (u < 256) { *q++ = 0xcc; bytes = 1; }
        else if (u < 65536) { *q++ = 0xcd; bytes = 2; }
        else if (u <= 0xffffffffULL) { *q++ = 0xce; bytes = 4; }
        else { *q++ = 0xcf; bytes = 8; }
    } else {
        if (v >= -32) { *q++ = (unsigned char)(signed char)v; return q; }
        if (v >= -128) { *q++ = 0xd0; bytes = 1; }
        else if (v >= -32768) { *q++ = 0xd1; bytes = 2; }
        else if (v >= -2147483648LL) { *q++ = 0xd2; bytes = 4; }
        else { *q++ = 0xd3; bytes = 8; }
    }
    for (int s = 8 * (bytes - 1); s >= 0; s -= 8) *q++ = (unsigned char)(u >> s);
    return q;
}

static int
bounds(PyObject *list, Py_ssize_t a, Py_ssize_t b)
{
    return 0 <= a && a <= b && b <= PyList_GET_SIZE(list) && b - a <= 0xffffffffLL;
}

static PyObject *
finish(PyObject *out, unsigned char *end)
{
    if (_PyBytes_Resize(&out, (char *)end - PyBytes_AS_STRING(out)) < 0)
        return NULL;
    return out;
}

static PyObject *
hex_array(PyObject *self, PyObject *args)
{
    PyObject *keys, *out;
    Py_ssize_t a, b, size = 5;
    if (!PyArg_ParseTuple(args, "O!nn", &PyList_Type, &keys, &a, &b))
        return NULL;
    if (!bounds(keys, a, b))
        Py_RETURN_NONE;
    for (Py_ssize_t i = a; i < b; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(k) || !PyUnicode_IS_COMPACT_ASCII(k))
            Py_RETURN_NONE;
        Py_ssize_t len = PyUnicode_GET_LENGTH(k);
        if (len == 0 || len % 2 || len > 510)
            Py_RETURN_NONE;
        size += 2 + len / 2;
    }
    if (!(out = PyBytes_FromStringAndSize(NULL, size)))
        return NULL;
    unsigned char *q = put_header((unsigned char *)PyBytes_AS_STRING(out), b - a);
    for (Py_ssize_t i = a; i < b; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        const unsigned char *s = PyUnicode_DATA(k);
        Py_ssize_t len = PyUnicode_GET_LENGTH(k);
        *q++ = 0xc4;
        *q++ = (unsigned char)(len / 2);
        for (Py_ssize_t j = 0; j < len; j += 2) {
            int hi = HEX[s[j]], lo = HEX[s[j + 1]];
            if ((hi | lo) < 0) {
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
            *q++ = (unsigned char)(hi << 4 | lo);
        }
    }
    return finish(out, q);
}

static PyObject *
flat_ints(PyObject *self, PyObject *args)
{
    PyObject *lists, *out;
    Py_ssize_t a, b, count = 0;
    if (!PyArg_ParseTuple(args, "O!nn", &PyList_Type, &lists, &a, &b))
        return NULL;
    if (!bounds(lists, a, b))
        Py_RETURN_NONE;
    for (Py_ssize_t i = a; i < b; i++) {
        PyObject *l = PyList_GET_ITEM(lists, i);
        if (!PyList_CheckExact(l))
            Py_RETURN_NONE;
        count += PyList_GET_SIZE(l);
    }
    if (count > 0xffffffffLL)
        Py_RETURN_NONE;
    if (!(out = PyBytes_FromStringAndSize(NULL, 5 + 9 * count)))
        return NULL;
    unsigned char *q = put_header((unsigned char *)PyBytes_AS_STRING(out), count);
    for (Py_ssize_t i = a; i < b; i++) {
        PyObject *l = PyList_GET_ITEM(lists, i);
        Py_ssize_t m = PyList_GET_SIZE(l);
        if (m > count) {   /* longer than counted: no Python code runs here, but never overrun */
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        count -= m;
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *x = PyList_GET_ITEM(l, j);
            int overflow;
            long long v = PyLong_CheckExact(x) ? PyLong_AsLongLongAndOverflow(x, &overflow) : 0;
            if (!PyLong_CheckExact(x) || overflow) {
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
            q = put_int(q, v);
        }
    }
    return finish(out, q);
}

static PyMethodDef methods[] = {
    {"hex_array", hex_array, METH_VARARGS, "msgpack array of bin items from hex keys[a:b], or None"},
    {"flat_ints", flat_ints, METH_VARARGS, "msgpack array of the ints of lists[a:b] in order, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_evpack", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__evpack(void)
{
    memset(HEX, -1, sizeof HEX);
    for (int c = 0; c < 10; c++) HEX['0' + c] = (signed char)c;
    for (int c = 0; c < 6; c++) HEX['a' + c] = HEX['A' + c] = (signed char)(10 + c);
    return PyModule_Create(&module);
}
