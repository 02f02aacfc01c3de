/* kubetron._hostcopy: the host-memory copies of a checkpoint snapshot, with non-temporal stores.
 *
 * An async save blocks the training loop only while this rank's state is copied into host buffers
 * (checkpoint/hostcopy.py, HostBuffers.batch); a background thread writes those buffers out later. The
 * destination is not read again soon, so it need not pass through the caches: streaming stores skip
 * the read-for-ownership of every destination line (a third of a plain copy's memory traffic) and do
 * not evict the working set. glibc switches its memcpy to such stores only above a threshold it
 * derives from the L3 size (190 MB on the 480 MB-L3 VM this was measured on), far above one
 * snapshot piece (KBs to MBs), so it copies those with `rep movsb`.
 *
 * Measured (bench/checkpoint.py --ranks 2: 77 MB per rank in 204 pieces, both ranks at once): the
 * snapshot's copies took 12.1-13.1 ms by libc memmove, 7.7-8.2 ms by this (5.7-6.2 ms vs 11.1-11.8 ms
 * in a tight loop, where part of the source is still cached). The loop below is glibc's own large-copy
 * scheme (sysdeps/x86_64/multiarch/memmove-vec-unaligned-erms.S, large_memcpy_4x): four pages
 * interleaved, so four DRAM pages stream at once, with software prefetch ahead of the loads.
 *
 * SSE2 only (part of x86-64 itself, no CPU dispatch needed). Other architectures, and pieces shorter
 * than four pages, use memcpy. Built by `pip install` (setup.py, an optional extension): where no
 * compiler is found, checkpoint/hostcopy.py falls back to ctypes.memmove, which gives the same bytes.
 *
 * The Python API (the limited API, so one build serves every CPython >= 3.11):
 *   copy_many(items)  items: a list of (dst_address, src_address, nbytes) int tuples; the ranges
 *                     must not overlap. The GIL is released while copying.
 *   NONTEMPORAL       True where the streaming path is compiled in (x86-64), else False.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HOSTCOPY_NT 1
#else
#define HOSTCOPY_NT 0
#endif

#define PAGE 4096
#define LINE 64

typedef struct {
    char *dst;
    const char *src;
    size_t n;
} piece;

#if HOSTCOPY_NT
static void copy_nt(char *dst, const char *src, size_t n)
{
    size_t head = (LINE - ((uintptr_t)dst & (LINE - 1))) & (LINE - 1);
    if (n < 4 * PAGE + head) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head); /* up to the first destination cache line */
    dst += head;
    src += head;
    n -= head;
    size_t blocks = n / (4 * PAGE);
    for (size_t b = 0; b < blocks; b++) {
        const char *s = src + b * 4 * PAGE;
        char *d = dst + b * 4 * PAGE;
        for (size_t off = 0; off < PAGE; off += LINE) {
            for (int k = 0; k < 4; k++) {
                const char *sp = s + k * PAGE + off;
                char *dp = d + k * PAGE + off;
                __builtin_prefetch(sp + 4 * LINE);
                __m128i a0 = _mm_loadu_si128((const __m128i *)sp);
                __m128i a1 = _mm_loadu_si128((const __m128i *)(sp + 16));
                __m128i a2 = _mm_loadu_si128((const __m128i *)(sp + 32));
                __m128i a3 = _mm_loadu_si128((const __m128i *)(sp + 48));
                _mm_stream_si128((__m128i *)dp, a0);
                _mm_stream_si128((__m128i *)(dp + 16), a1);
                _mm_stream_si128((__m128i *)(dp + 32), a2);
                _mm_stream_si128((__m128i *)(dp + 48), a3);
            }
        }
    }
    size_t done = blocks * 4 * PAGE;
    memcpy(dst + done, src + done, n - done);
}
#endif

static void copy_all(const piece *p, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
#if HOSTCOPY_NT
        copy_nt(p[i].dst, p[i].src, p[i].n);
#else
        memcpy(p[i].dst, p[i].src, p[i].n);
#endif
    }
#if HOSTCOPY_NT
    _mm_sfence(); /* the streamed lines are visible before anything this thread does next */
#endif
}

static int as_size(PyObject *o, size_t *out, const char *what, Py_ssize_t i)
{
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "copy_many: item %zd: %s must be a non-negative int", i, what);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *copy_many(PyObject *self, PyObject *items)
{
    (void)self;
    if (!PyList_Check(items)) {
        PyErr_SetString(PyExc_TypeError, "copy_many: expects a list of (dst, src, nbytes) tuples");
        return NULL;
    }
    Py_ssize_t count = PyList_Size(items);
    piece *p = PyMem_Malloc((count ? count : 1) * sizeof(piece));
    if (p == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PyList_GetItem(items, i); /* borrowed */
        if (!PyTuple_Check(t) || PyTuple_Size(t) != 3) {
            PyMem_Free(p);
            PyErr_Format(PyExc_TypeError, "copy_many: item %zd is not a (dst, src, nbytes) tuple", i);
            return NULL;
        }
        size_t dst, src, n;
        if (as_size(PyTuple_GetItem(t, 0), &dst, "dst", i) || as_size(PyTuple_GetItem(t, 1), &src, "src", i)
            || as_size(PyTuple_GetItem(t, 2), &n, "nbytes", i)) {
            PyMem_Free(p);
            return NULL;
        }
        if (n && (dst == 0 || src == 0)) {
            PyMem_Free(p);
            PyErr_Format(PyExc_ValueError, "copy_many: item %zd: null address", i);
            return NULL;
        }
        p[i].dst = (char *)(uintptr_t)dst;
        p[i].src = (const char *)(uintptr_t)src;
        p[i].n = n;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_all(p, count);
    Py_END_ALLOW_THREADS
    PyMem_Free(p);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_O,
     "copy_many(items): copy each (dst_address, src_address, nbytes) of a list; non-temporal stores "
     "on x86-64; the GIL is released while copying."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kubetron._hostcopy",
    "Snapshot copies into host buffers with non-temporal stores (see the source's header).", -1, methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObject(m, "NONTEMPORAL", PyBool_FromLong(HOSTCOPY_NT)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
