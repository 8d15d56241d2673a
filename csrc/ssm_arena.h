/*
 * ssm_arena.h -- a bump allocator over the caller's scratch (the kernels never allocate: the
 * caller asks *_work_size() and passes one buffer aligned to SSM_WORK_ALIGN). Internal.
 *
 * A work-size query runs the same takes over an arena whose base is NULL and reads how far it
 * went; the kernel runs them over the caller's buffer: both walk one sequence of takes, so the
 * size and the layout agree by construction.
 */
#ifndef SSM_ARENA_H
#define SSM_ARENA_H

#include <stddef.h>

#include "ssmgrad.h"

/* A bump allocator over caller-provided scratch: every piece 64-byte aligned. */
typedef struct {
    char * base;
    size_t off;
} ssm_arena;

static inline void * ssm_take(ssm_arena * a, size_t bytes) {
    void * ptr = a->base ? a->base + a->off : NULL;
    a->off += (bytes + SSM_WORK_ALIGN - 1) / SSM_WORK_ALIGN * SSM_WORK_ALIGN;
    return ptr;
}

#endif /* SSM_ARENA_H */
