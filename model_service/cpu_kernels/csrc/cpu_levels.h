/* How every kernel family picks its instruction-set level: one scheme for all of them.
 *
 * A family's levels are indices, portable first (levels.py and the family's wrapper
 * module list their names in that order). Each family declares, in its source:
 * - a table of the CPU checks each level needs ({0, cpu_avx2_fma, ...}: entry 0, the
 *   portable level, needs none), and answers its *_best_level with best_level(table),
 *   the highest level whose check passes;
 * - for each piece of code that differs by level, a table of that code's variants by
 *   level, and takes the caller's level's entry with LEVEL_PICK (0 where a level has no
 *   variant of its own, which the caller treats as "none", as quant_matmul.c's x16 path).
 * The Python side chooses the level once per process (levels.py) and passes it with each
 * call; a level above the CPU's best is refused where the family's entry points say so.
 *
 * The SIMD levels are built with `#pragma GCC target` whatever -march says, so one library
 * serves every level this CPU has and a test can force each; on a CPU without x86 every
 * x86 entry reads 0 (X86_LEVEL).
 *
 * Where the code lies: a family's .c (csrc/) holds its entry points and these tables;
 * generic/ its portable level's code, x86/ each x86 level's (FAMILY_LEVEL.h, under that
 * level's target pragma), each included by the family's .c at one place. A new level (or
 * another architecture's folder) is a new file there, an #include, and a row in the
 * family's tables. */
#ifndef PAGEDKV_CPU_LEVELS_H
#define PAGEDKV_CPU_LEVELS_H

#if defined(__x86_64__) || defined(__i386__)
#define CPU_LEVELS_X86 1
/* An x86 level's entry in a table: the entry itself on x86, 0 elsewhere. */
#define X86_LEVEL(entry) (entry)
#else
#define CPU_LEVELS_X86 0
#define X86_LEVEL(entry) 0
#endif

typedef int (*cpu_check_fn)(void);

#if CPU_LEVELS_X86
/* __builtin_cpu_supports takes string constants only: one function per set a level needs. */
static inline int cpu_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static inline int cpu_avx2_fma_f16c(void) { return cpu_avx2_fma() && __builtin_cpu_supports("f16c"); }

static inline int cpu_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* AVX-512F with AVX2, FMA and F16C (decode attention's AVX-512 case is built for all four). */
static inline int cpu_avx512f_avx2(void) { return cpu_avx2_fma_f16c() && cpu_avx512f(); }

/* AVX-512 BF16 with BW and VL (the bfloat16 linears' dpbf16ps tiles). */
static inline int cpu_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl");
}

/* And AVX-512F with AVX2, FMA and F16C besides (prefill attention's top level: its dpbf16ps
 * tile, and the AVX-512F level's tile for float32 pools). */
static inline int cpu_avx512f_avx2_bf16(void) { return cpu_avx512f_avx2() && cpu_avx512_bf16(); }

/* AVX-512 VNNI with VL and BW, on top of AVX2 and FMA (the quantized products). */
static inline int cpu_avx512_vnni(void) {
    return cpu_avx2_fma() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
           && __builtin_cpu_supports("avx512bw");
}
#endif

static inline int best_level_of(const cpu_check_fn *checks, int count) {
    int best = 0;
    for (int level = 1; level < count; level++)
        if (checks[level] != 0 && checks[level]()) best = level;
    return best;
}

/* The highest level of a family's table of checks that this CPU passes. */
#define best_level(checks) best_level_of((checks), (int)(sizeof(checks) / sizeof((checks)[0])))

/* A level as an index into a table of `count` entries: below 0 the portable one, past the
 * table its top. */
static inline int level_index(int level, int count) { return level < 0 ? 0 : level < count ? level : count - 1; }

/* The entry of a table of variants by level for `level`. */
#define LEVEL_PICK(table, level) ((table)[level_index((level), (int)(sizeof(table) / sizeof((table)[0])))])

#endif
