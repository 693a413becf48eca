/* One pass of SGD / Adam / AdamW over float32 arrays, in place: the shard's optimizer step in C.
 *
 * `hybridfleet.ps.server.optim` computes each step with numpy, reproducing torch.optim's and
 * Paddle's float32 arithmetic (see its docstring): about eight passes over the tensor and its two
 * slots, each a numpy temporary. Here the same operations, in the same order and precision, run
 * element by element in one pass: every float32 operation is a float32 operation, and each of the
 * numpy path's fused multiply-adds (`_fma`: the product exact in double, the sum rounded to double
 * and then to float32) is the same two roundings here. The scalars (bias corrections, step size,
 * Paddle's lr_t and eps_t) come computed by the Python code as before. Compiled with
 * -ffp-contract=off, so the compiler fuses nothing itself; tests/test_ps_optim.py checks the result
 * against the numpy path to the bit, and both against torch.optim and Paddle.
 * Built optionally (see pyproject.toml); without it the numpy path runs. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2 };

/* Loads and stores through memcpy: a buffer may start anywhere (a gradient read from the wire at
 * any offset; numpy marks such arrays unaligned), and the compiler turns these into unaligned
 * vector moves. */
static inline float ld(const char *base, Py_ssize_t i) {
    float x;
    memcpy(&x, base + 4 * i, 4);
    return x;
}
static inline void st(char *base, Py_ssize_t i, float x) { memcpy(base + 4 * i, &x, 4); }

/* a * b + c as the numpy path's _fma: double product (exact), double sum, then float32 */
static inline float fma2(float a, float b, float c) { return (float)((double)a * (double)b + (double)c); }

#define INLINE static inline __attribute__((always_inline))

/* The loops take their choices (decay, lerp branch) as constants, so each instance has no branch
 * inside and vectorizes. */
INLINE void torch_loop(char *restrict p, const char *restrict g, char *restrict m, char *restrict v, Py_ssize_t n,
                       const int decay, const int low, float wd, float keep, float weight, float c2, float b2,
                       float neg_step, float bc2, float eps) {
    float weight_m1 = weight - 1.0f;
    for (Py_ssize_t i = 0; i < n; i++) {
        float pi = ld(p, i), gi = ld(g, i), mi = ld(m, i), vi = ld(v, i);
        if (decay == DECAY_DECOUPLED) pi = pi * keep;
        if (decay == DECAY_L2) gi = fma2(wd, pi, gi);
        float d = gi - mi;
        mi = low ? fma2(weight, d, mi) : fma2(weight_m1, d, gi); /* exp_avg.lerp_(grad, 1 - beta1) */
        vi = fma2(c2 * gi, gi, vi * b2);
        float denom = sqrtf(vi) / bc2 + eps;
        st(p, i, pi + (neg_step * mi) / denom);
        st(m, i, mi);
        st(v, i, vi);
    }
}

INLINE void adam_torch_body(char *restrict p, const char *restrict g, char *restrict m,
                                     char *restrict v, Py_ssize_t n, int decay, float wd, float keep, float weight,
                                     float c2, float b2, float neg_step, float bc2, float eps) {
#define TORCH(D, L) torch_loop(p, g, m, v, n, D, L, wd, keep, weight, c2, b2, neg_step, bc2, eps)
    int low = weight < 0.5f;
    if (decay == DECAY_NONE) low ? TORCH(DECAY_NONE, 1) : TORCH(DECAY_NONE, 0);
    else if (decay == DECAY_L2) low ? TORCH(DECAY_L2, 1) : TORCH(DECAY_L2, 0);
    else low ? TORCH(DECAY_DECOUPLED, 1) : TORCH(DECAY_DECOUPLED, 0);
#undef TORCH
}

INLINE void paddle_loop(char *restrict p, const char *restrict g, char *restrict m, char *restrict v, Py_ssize_t n,
                        const int decay, float wd, float neg_coeff, float beta1, float one_minus_b1, float beta2,
                        float one_minus_b2, float neg_lr_t, float eps_t) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float pi = ld(p, i), gi = ld(g, i);
        if (decay == DECAY_DECOUPLED) pi = fma2(neg_coeff, pi, pi);
        if (decay == DECAY_L2) gi = gi + pi * wd;
        float mi = fma2(beta1, ld(m, i), one_minus_b1 * gi);
        float vi = fma2(beta2, ld(v, i), one_minus_b2 * (gi * gi));
        st(p, i, fma2(neg_lr_t, mi / (sqrtf(vi) + eps_t), pi));
        st(m, i, mi);
        st(v, i, vi);
    }
}

INLINE void adam_paddle_body(char *restrict p, const char *restrict g, char *restrict m,
                                      char *restrict v, Py_ssize_t n, int decay, float wd, float neg_coeff,
                                      float beta1, float one_minus_b1, float beta2, float one_minus_b2,
                                      float neg_lr_t, float eps_t) {
#define PADDLE(D) paddle_loop(p, g, m, v, n, D, wd, neg_coeff, beta1, one_minus_b1, beta2, one_minus_b2, neg_lr_t, eps_t)
    if (decay == DECAY_NONE) PADDLE(DECAY_NONE);
    else if (decay == DECAY_L2) PADDLE(DECAY_L2);
    else PADDLE(DECAY_DECOUPLED);
#undef PADDLE
}

/* SGD: flags say what the step does; the momentum buffer is NULL without momentum. */
enum { SGD_WD = 1, SGD_MOMENTUM = 2, SGD_NESTEROV = 4, SGD_FIRST = 8 };

INLINE void sgd_torch_loop(char *restrict p, const char *restrict g, char *restrict b, Py_ssize_t n, const int flags,
                           float neg_lr, float mu, float wd) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float pi = ld(p, i), gi = ld(g, i);
        if (flags & SGD_WD) gi = fma2(wd, pi, gi);
        if (flags & SGD_MOMENTUM) {
            float bi = (flags & SGD_FIRST) ? gi : ld(b, i) * mu + gi; /* torch's first buffer: the gradient */
            st(b, i, bi);
            gi = (flags & SGD_NESTEROV) ? fma2(mu, bi, gi) : bi;
        }
        st(p, i, fma2(neg_lr, gi, pi));
    }
}

INLINE void sgd_paddle_loop(char *restrict p, const char *restrict g, char *restrict b, Py_ssize_t n, const int flags,
                            float lr, float mu, float wd) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float pi = ld(p, i), gi = ld(g, i);
        if (flags & SGD_WD) gi = pi * wd + gi;
        if (!(flags & SGD_MOMENTUM)) {
            st(p, i, pi - lr * gi);
            continue;
        }
        float vi = ld(b, i) * mu + gi;
        st(b, i, vi);
        st(p, i, (flags & SGD_NESTEROV) ? pi - (gi + vi * mu) * lr : pi - lr * vi);
    }
}

INLINE void sgd_body(int paddle, char *restrict p, const char *restrict g, char *restrict b, Py_ssize_t n,
                              int flags, float lr, float mu, float wd) {
    /* every combination as its own loop, without a branch inside (see torch_loop) */
#define CASE(F)                                                                                                        \
    case F:                                                                                                            \
        if (paddle) sgd_paddle_loop(p, g, b, n, F, lr, mu, wd);                                                        \
        else sgd_torch_loop(p, g, b, n, F, -lr, mu, wd);                                                               \
        break;
    switch (flags) {
        CASE(0) CASE(1) CASE(2) CASE(3) CASE(6) CASE(7) CASE(10) CASE(11) CASE(14) CASE(15)
    default: break; /* refused before (py_sgd) */
    }
#undef CASE
}

/* One build runs everywhere: each step is compiled for AVX-512, AVX2 and the x86-64 baseline (the
 * same arithmetic in each: IEEE float32/float64, nothing fused), and the best the CPU has runs;
 * `_set_isa` picks a lower one, so that tests check every copy against the numpy path. */
#define ADAM_TORCH_PARAMS                                                                                              \
    (char *restrict p, const char *restrict g, char *restrict m, char *restrict v, Py_ssize_t n, int decay, float wd,  \
     float keep, float weight, float c2, float b2, float neg_step, float bc2, float eps)
#define ADAM_TORCH_ARGS (p, g, m, v, n, decay, wd, keep, weight, c2, b2, neg_step, bc2, eps)
#define ADAM_PADDLE_PARAMS                                                                                             \
    (char *restrict p, const char *restrict g, char *restrict m, char *restrict v, Py_ssize_t n, int decay, float wd,  \
     float neg_coeff, float beta1, float one_minus_b1, float beta2, float one_minus_b2, float neg_lr_t, float eps_t)
#define ADAM_PADDLE_ARGS (p, g, m, v, n, decay, wd, neg_coeff, beta1, one_minus_b1, beta2, one_minus_b2, neg_lr_t, eps_t)
#define SGD_PARAMS                                                                                                     \
    (int paddle, char *restrict p, const char *restrict g, char *restrict b, Py_ssize_t n, int flags, float lr, float mu, \
     float wd)
#define SGD_ARGS (paddle, p, g, b, n, flags, lr, mu, wd)

enum { ISA_BASELINE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *const ISA_NAMES[] = {"baseline", "avx2", "avx512f"};
static int isa_best = ISA_BASELINE, isa_used = ISA_BASELINE;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VARIANTS(NAME, PARAMS, ARGS)                                                                                   \
    __attribute__((target("avx512f"))) static void NAME##_avx512 PARAMS { NAME##_body ARGS; }                          \
    __attribute__((target("avx2"))) static void NAME##_avx2 PARAMS { NAME##_body ARGS; }                               \
    static void NAME##_baseline PARAMS { NAME##_body ARGS; }
#define RUN(NAME, ARGS)                                                                                                \
    (isa_used == ISA_AVX512 ? NAME##_avx512 ARGS : isa_used == ISA_AVX2 ? NAME##_avx2 ARGS : NAME##_baseline ARGS)
static void detect_isa(void) {
    __builtin_cpu_init();
    isa_best = __builtin_cpu_supports("avx512f") ? ISA_AVX512 : __builtin_cpu_supports("avx2") ? ISA_AVX2 : ISA_BASELINE;
    isa_used = isa_best;
}
#else
#define VARIANTS(NAME, PARAMS, ARGS) static void NAME##_baseline PARAMS { NAME##_body ARGS; }
#define RUN(NAME, ARGS) NAME##_baseline ARGS
static void detect_isa(void) {}
#endif

VARIANTS(adam_torch, ADAM_TORCH_PARAMS, ADAM_TORCH_ARGS)
VARIANTS(adam_paddle, ADAM_PADDLE_PARAMS, ADAM_PADDLE_ARGS)
VARIANTS(sgd, SGD_PARAMS, SGD_ARGS)

/* "f", or "<f" / "=f" / "@f" (a numpy float32 array may say its byte order): float32 in this
 * machine's byte order. */
static int native_float32(const char *format) {
    if (format == NULL) return 0;
    if (format[0] == '@' || format[0] == '=' || (format[0] == '<' && PY_LITTLE_ENDIAN) ||
        (format[0] == '>' && !PY_LITTLE_ENDIAN) || (format[0] == '!' && !PY_LITTLE_ENDIAN))
        format++;
    return strcmp(format, "f") == 0;
}

/* The k buffers (param, grad, slots): float32, C-contiguous, the same length; all but grad writable. */
static int take(PyObject *const objs[], Py_buffer views[], int k) {
    int got = 0;
    for (; got < k; got++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got == 1 ? 0 : PyBUF_WRITABLE);
        if (PyObject_GetBuffer(objs[got], &views[got], flags) < 0) goto fail;
        if (views[got].itemsize != 4 || !native_float32(views[got].format)) {
            got++;
            PyErr_SetString(PyExc_ValueError, "param, grad and their slots must be float32");
            goto fail;
        }
        if (views[got].len != views[0].len) {
            got++;
            PyErr_SetString(PyExc_ValueError, "param, grad and their slots must have the same size");
            goto fail;
        }
    }
    return 0;
fail:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    return -1;
}

static PyObject *py_adam(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objs[4];
    const char *flavour;
    int decay;
    double s[8];
    if (!PyArg_ParseTuple(args, "OOOOsi(dddddddd):adam", &objs[0], &objs[1], &objs[2], &objs[3], &flavour, &decay, &s[0],
                          &s[1], &s[2], &s[3], &s[4], &s[5], &s[6], &s[7]))
        return NULL;
    int paddle = strcmp(flavour, "paddle") == 0;
    if (!paddle && strcmp(flavour, "torch") != 0)
        return PyErr_Format(PyExc_ValueError, "adam: flavour must be torch or paddle (got %s)", flavour);
    if (decay < DECAY_NONE || decay > DECAY_DECOUPLED)
        return PyErr_Format(PyExc_ValueError, "adam: decay must be 0, 1 or 2 (got %d)", decay);
    Py_buffer b[4];
    if (take(objs, b, 4) < 0) return NULL;
    Py_ssize_t n = b[0].len / 4;
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = (float)s[i]; /* each was a float32 value in Python: exact */
    Py_BEGIN_ALLOW_THREADS
    if (paddle)
        RUN(adam_paddle, (b[0].buf, b[1].buf, b[2].buf, b[3].buf, n, decay, f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]));
    else
        RUN(adam_torch, (b[0].buf, b[1].buf, b[2].buf, b[3].buf, n, decay, f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]));
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 4; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

static PyObject *py_sgd(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objs[3];
    const char *flavour;
    int flags;
    double lr, mu, wd;
    if (!PyArg_ParseTuple(args, "OOOsiddd:sgd", &objs[0], &objs[1], &objs[2], &flavour, &flags, &lr, &mu, &wd))
        return NULL;
    int paddle = strcmp(flavour, "paddle") == 0;
    if (!paddle && strcmp(flavour, "torch") != 0)
        return PyErr_Format(PyExc_ValueError, "sgd: flavour must be torch or paddle (got %s)", flavour);
    int momentum = (flags & SGD_MOMENTUM) != 0;
    if (flags < 0 || flags > 15 || (!momentum && (flags & (SGD_NESTEROV | SGD_FIRST))) ||
        (paddle && (flags & SGD_FIRST)) || momentum != (objs[2] != Py_None))
        return PyErr_Format(PyExc_ValueError, "sgd: flags %d do not fit the %s step and its buffer", flags, flavour);
    Py_buffer b[3];
    if (take(objs, b, momentum ? 3 : 2) < 0) return NULL;
    Py_ssize_t n = b[0].len / 4;
    Py_BEGIN_ALLOW_THREADS
    RUN(sgd, (paddle, b[0].buf, b[1].buf, momentum ? b[2].buf : NULL, n, flags, (float)lr, (float)mu, (float)wd));
    Py_END_ALLOW_THREADS
    for (int i = 0; i < (momentum ? 3 : 2); i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

/* _isas() -> the instruction sets this CPU runs, best last; _set_isa(name) -> the one used before. */
static PyObject *py_isas(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    (void)module;
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i <= isa_best; i++) {
        PyObject *name = PyUnicode_FromString(ISA_NAMES[i]);
        if (name == NULL || PyList_Append(out, name) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
    }
    return out;
}

static PyObject *py_set_isa(PyObject *module, PyObject *arg) {
    (void)module;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    for (int i = 0; i <= isa_best; i++) {
        if (strcmp(name, ISA_NAMES[i]) == 0) {
            const char *before = ISA_NAMES[isa_used];
            isa_used = i;
            return PyUnicode_FromString(before);
        }
    }
    return PyErr_Format(PyExc_ValueError, "_set_isa: this CPU runs %s at most (got %s)", ISA_NAMES[isa_best], name);
}

static PyMethodDef methods[] = {
    {"_isas", py_isas, METH_NOARGS, "_isas() -> the instruction sets this CPU runs the steps with, best last."},
    {"_set_isa", py_set_isa, METH_O, "_set_isa(name) -> previous: run the steps' copy for that set (tests)."},
    {"sgd", py_sgd, METH_VARARGS,
     "sgd(param, grad, momentum_buffer|None, flavour, flags, lr, momentum, weight_decay): one SGD step in\n"
     "place. flags: 1 weight decay, 2 momentum, 4 Nesterov, 8 first step (torch: the buffer starts as the\n"
     "gradient). lr, momentum, weight_decay: float32 values."},
    {"adam", py_adam, METH_VARARGS,
     "adam(param, grad, exp_avg, exp_avg_sq, flavour, decay, scalars): one Adam/AdamW step in place.\n"
     "decay: 0 none, 1 L2 on the gradient, 2 decoupled. scalars (float32 values, 8 of them):\n"
     "torch: (wd, 1 - lr*wd, 1 - beta1, 1 - beta2, beta2, -step_size, sqrt(bias_correction2), eps);\n"
     "paddle: (wd, -lr*wd, beta1, 1 - beta1, beta2, 1 - beta2, -lr_t, eps_t)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_optim", "The shard optimizer's step in one pass.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__optim(void) {
    detect_isa();
    return PyModule_Create(&module);
}
