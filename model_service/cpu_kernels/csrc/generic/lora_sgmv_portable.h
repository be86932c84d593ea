/* lora_sgmv.c's portable level (included by it): a value at a time. */

static float dot_portable(const float *x, const float *y, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * y[i];
    return sum;
}

static void axpy_portable(float alpha, const float *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

static void expand_portable(const float *s, int rank, const float *b, int out_f, float *out) {
    for (int o = 0; o < out_f; o++) out[o] += dot_portable(s, b + (int64_t)o * rank, rank);
}

static void shrink_portable(const float *x, const float *a, int rank, int in_f, float scaling, float *shrunk) {
    for (int j = 0; j < rank; j++) shrunk[j] = scaling * dot_portable(x, a + (int64_t)j * in_f, in_f);
}
