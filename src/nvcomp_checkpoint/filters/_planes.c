/* Byte-plane split and join in one pass (nvcomp_checkpoint.filters._planes).
 *
 * The same bytes as the numpy code in byteplane.py and rotate.py, which stays the fallback when
 * this module is not built: numpy needs 10-13 passes over a block to interleave planes and undo
 * the rotation, this loop one (the compiler vectorizes it), so the load's un-split runs about 3x
 * faster (benchmarks/README.md). Planes are numbered from the least significant byte of the
 * little-endian element word; "rotate" is the left rotation of the words before they were split
 * (filters/rotate.py), 0 for plain byte planes.
 *
 * Every length is checked before a byte is touched: a plane shorter or longer than the output's
 * elements raises ValueError (a forged index must not make us read or write out of bounds). The
 * loops run without the GIL, so decoding workers join planes in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_WIDTH 8
/* Elements staged per step when the output is not aligned to its word (rare: numpy buffers are). */
#define STAGE 2048

/* ---- join: planes -> element words ------------------------------------------------------- */

static void join2(uint16_t *restrict out, const uint8_t *const *planes, size_t n, unsigned r) {
    const uint8_t *restrict p0 = planes[0], *restrict p1 = planes[1];
    if (r == 0) {
        for (size_t i = 0; i < n; i++) out[i] = (uint16_t)(p0[i] | (p1[i] << 8));
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t w = (uint16_t)(p0[i] | (p1[i] << 8));
            out[i] = (uint16_t)((w >> r) | (w << (16 - r)));
        }
    }
}

static void join4(uint32_t *restrict out, const uint8_t *const *planes, size_t n, unsigned r) {
    const uint8_t *restrict p0 = planes[0], *restrict p1 = planes[1];
    const uint8_t *restrict p2 = planes[2], *restrict p3 = planes[3];
    if (r == 0) {
        for (size_t i = 0; i < n; i++)
            out[i] = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t w = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
            out[i] = (w >> r) | (w << (32 - r));
        }
    }
}

static void join8(uint64_t *restrict out, const uint8_t *const *planes, size_t n) {
    const uint8_t *restrict p0 = planes[0], *restrict p1 = planes[1];
    const uint8_t *restrict p2 = planes[2], *restrict p3 = planes[3];
    const uint8_t *restrict p4 = planes[4], *restrict p5 = planes[5];
    const uint8_t *restrict p6 = planes[6], *restrict p7 = planes[7];
    for (size_t i = 0; i < n; i++)
        out[i] = (uint64_t)p0[i] | ((uint64_t)p1[i] << 8) | ((uint64_t)p2[i] << 16) | ((uint64_t)p3[i] << 24) |
                 ((uint64_t)p4[i] << 32) | ((uint64_t)p5[i] << 40) | ((uint64_t)p6[i] << 48) | ((uint64_t)p7[i] << 56);
}

static void join_aligned(void *out, const uint8_t *const *planes, size_t n, int width, unsigned r) {
    if (width == 2) join2((uint16_t *)out, planes, n, r);
    else if (width == 4) join4((uint32_t *)out, planes, n, r);
    else join8((uint64_t *)out, planes, n);
}

static void join_any(uint8_t *out, const uint8_t *const *planes, size_t n, int width, unsigned r) {
    if (((uintptr_t)out % (uintptr_t)width) == 0) {
        join_aligned(out, planes, n, width, r);
        return;
    }
    uint64_t stage[STAGE];
    const uint8_t *step[MAX_WIDTH];
    for (size_t start = 0; start < n; start += STAGE) {
        size_t count = n - start < STAGE ? n - start : STAGE;
        for (int p = 0; p < width; p++) step[p] = planes[p] + start;
        join_aligned(stage, step, count, width, r);
        memcpy(out + start * (size_t)width, stage, count * (size_t)width);
    }
}

/* ---- split: element words -> planes ------------------------------------------------------- */

static void split2(const uint16_t *restrict words, uint8_t *const *planes, size_t n, unsigned r) {
    uint8_t *restrict p0 = planes[0], *restrict p1 = planes[1];
    for (size_t i = 0; i < n; i++) {
        uint16_t w = words[i];
        if (r) w = (uint16_t)((w << r) | (w >> (16 - r)));
        p0[i] = (uint8_t)w;
        p1[i] = (uint8_t)(w >> 8);
    }
}

static void split4(const uint32_t *restrict words, uint8_t *const *planes, size_t n, unsigned r) {
    uint8_t *restrict p0 = planes[0], *restrict p1 = planes[1];
    uint8_t *restrict p2 = planes[2], *restrict p3 = planes[3];
    if (r == 0) {
        for (size_t i = 0; i < n; i++) {
            uint32_t w = words[i];
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            p2[i] = (uint8_t)(w >> 16);
            p3[i] = (uint8_t)(w >> 24);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t w = words[i];
            w = (w << r) | (w >> (32 - r));
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            p2[i] = (uint8_t)(w >> 16);
            p3[i] = (uint8_t)(w >> 24);
        }
    }
}

static void split8(const uint64_t *restrict words, uint8_t *const *planes, size_t n) {
    uint8_t *restrict p0 = planes[0], *restrict p1 = planes[1], *restrict p2 = planes[2], *restrict p3 = planes[3];
    uint8_t *restrict p4 = planes[4], *restrict p5 = planes[5], *restrict p6 = planes[6], *restrict p7 = planes[7];
    for (size_t i = 0; i < n; i++) {
        uint64_t w = words[i];
        p0[i] = (uint8_t)w;
        p1[i] = (uint8_t)(w >> 8);
        p2[i] = (uint8_t)(w >> 16);
        p3[i] = (uint8_t)(w >> 24);
        p4[i] = (uint8_t)(w >> 32);
        p5[i] = (uint8_t)(w >> 40);
        p6[i] = (uint8_t)(w >> 48);
        p7[i] = (uint8_t)(w >> 56);
    }
}

static void split_aligned(const void *words, uint8_t *const *planes, size_t n, int width, unsigned r) {
    if (width == 2) split2((const uint16_t *)words, planes, n, r);
    else if (width == 4) split4((const uint32_t *)words, planes, n, r);
    else split8((const uint64_t *)words, planes, n);
}

static void split_any(const uint8_t *data, uint8_t *const *planes, size_t n, int width, unsigned r) {
    if (((uintptr_t)data % (uintptr_t)width) == 0) {
        split_aligned(data, planes, n, width, r);
        return;
    }
    uint64_t stage[STAGE];
    uint8_t *step[MAX_WIDTH];
    for (size_t start = 0; start < n; start += STAGE) {
        size_t count = n - start < STAGE ? n - start : STAGE;
        for (int p = 0; p < width; p++) step[p] = planes[p] + start;
        memcpy(stage, data + start * (size_t)width, count * (size_t)width);
        split_aligned(stage, step, count, width, r);
    }
}

/* ---- argument checks, shared by both directions ---------------------------------------------- */

/* Takes one buffer per plane (writable ones for split) and checks the width, the rotation and every
 * length against the element buffer. Returns the plane count, or -1 with an exception set (the
 * buffers taken so far released). */
static int take_planes(PyObject *seq_obj, Py_buffer *views, int writable, Py_ssize_t total, unsigned rotate,
                       const char *what) {
    PyObject *seq = PySequence_Fast(seq_obj, "planes must be a sequence of buffers");
    if (seq == NULL) return -1;
    Py_ssize_t width = PySequence_Fast_GET_SIZE(seq);
    if (width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "byte-plane %s takes 2, 4 or 8 planes, got %zd", what, width);
        Py_DECREF(seq);
        return -1;
    }
    if (rotate >= (unsigned)(8 * width) || (rotate != 0 && width == 8)) {
        PyErr_Format(PyExc_ValueError, "byte-plane %s: rotation %u is not defined for %zd-byte words", what, rotate, width);
        Py_DECREF(seq);
        return -1;
    }
    if (total % width != 0) {
        PyErr_Format(PyExc_ValueError, "byte-plane %s: %zd element bytes are not a whole number of %zd-byte elements",
                     what, total, width);
        Py_DECREF(seq);
        return -1;
    }
    int flags = writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS;
    for (Py_ssize_t p = 0; p < width; p++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, p), &views[p], flags) < 0) {
            for (Py_ssize_t q = 0; q < p; q++) PyBuffer_Release(&views[q]);
            Py_DECREF(seq);
            return -1;
        }
        if (views[p].len != total / width) {
            PyErr_Format(PyExc_ValueError, "byte-plane %s: plane %zd holds %zd bytes, the elements need %zd", what, p,
                         views[p].len, total / width);
            for (Py_ssize_t q = 0; q <= p; q++) PyBuffer_Release(&views[q]);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return (int)width;
}

PyDoc_STRVAR(join_doc,
             "join(out, planes, rotate)\n--\n\n"
             "Write the element words of ``planes`` (2, 4 or 8 buffers of n bytes) into ``out`` (a writable\n"
             "buffer of n * len(planes) bytes), undoing a left rotation of ``rotate`` bits.");

static PyObject *planes_join(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *planes_obj;
    unsigned int rotate;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*OI:join", &out, &planes_obj, &rotate)) return NULL;
    Py_buffer views[MAX_WIDTH];
    int width = take_planes(planes_obj, views, 0, out.len, rotate, "join");
    if (width < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    const uint8_t *src[MAX_WIDTH];
    for (int p = 0; p < width; p++) src[p] = (const uint8_t *)views[p].buf;
    size_t n = (size_t)(out.len / width);
    Py_BEGIN_ALLOW_THREADS
    join_any((uint8_t *)out.buf, src, n, width, rotate);
    Py_END_ALLOW_THREADS
    for (int p = 0; p < width; p++) PyBuffer_Release(&views[p]);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(split_doc,
             "split(data, planes, rotate)\n--\n\n"
             "Write byte plane k of every element word of ``data`` (rotated left by ``rotate`` bits) into\n"
             "``planes[k]`` (2, 4 or 8 writable buffers of len(data) / len(planes) bytes).");

static PyObject *planes_split(PyObject *self, PyObject *args) {
    Py_buffer data;
    PyObject *planes_obj;
    unsigned int rotate;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*OI:split", &data, &planes_obj, &rotate)) return NULL;
    Py_buffer views[MAX_WIDTH];
    int width = take_planes(planes_obj, views, 1, data.len, rotate, "split");
    if (width < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint8_t *dst[MAX_WIDTH];
    for (int p = 0; p < width; p++) dst[p] = (uint8_t *)views[p].buf;
    size_t n = (size_t)(data.len / width);
    Py_BEGIN_ALLOW_THREADS
    split_any((const uint8_t *)data.buf, dst, n, width, rotate);
    Py_END_ALLOW_THREADS
    for (int p = 0; p < width; p++) PyBuffer_Release(&views[p]);
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyMethodDef planes_methods[] = {
    {"join", planes_join, METH_VARARGS, join_doc},
    {"split", planes_split, METH_VARARGS, split_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef planes_module = {
    PyModuleDef_HEAD_INIT, "_planes", "Byte-plane split and join in one pass (see byteplane.py).", -1, planes_methods,
};

PyMODINIT_FUNC PyInit__planes(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "nvcomp-checkpoint's byte-plane kernels assume a little-endian machine");
        return NULL;
    }
    return PyModule_Create(&planes_module);
}
