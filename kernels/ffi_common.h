/* What every native kernel's handler shares: its metadata answer, a named refusal, and running a call's items on
   XLA's own intra-op threads (the FFI thread pool) beside the calling thread: threads of another pool would wait
   for cores XLA's threads hold. Included by each kernel's C file; static, so each library has its own copy. */
#ifndef TLALOC_FFI_COMMON_H
#define TLALOC_FFI_COMMON_H
#define _POSIX_C_SOURCE 200809L /* sched_yield */
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "xla_ffi_c_api.h" /* XLA's xla/ffi/api/c_api.h, vendored */

#ifdef TLALOC_KERNEL_KEY
/* The sources a prebuilt library was compiled from (tlaloc_jax.native.source_key): the loader passes a stale one over. */
__attribute__((visibility("default"))) const char tlaloc_kernel_key[] = TLALOC_KERNEL_KEY;
#endif

/* XLA asks a handler its API version once, when it is registered: 1 if this call was that question. */
static int answered_metadata(XLA_FFI_CallFrame *frame) {
  for (XLA_FFI_Extension_Base *ext = frame->extension_start; ext; ext = ext->next)
    if (ext->type == XLA_FFI_Extension_Metadata) {
      XLA_FFI_Metadata *md = ((XLA_FFI_Metadata_Extension *)ext)->metadata;
      md->api_version.major_version = XLA_FFI_API_MAJOR;
      md->api_version.minor_version = XLA_FFI_API_MINOR;
      md->traits = 0;
      return 1;
    }
  return 0;
}

static XLA_FFI_Error *refuse(const XLA_FFI_Api *api, const char *message) {
  XLA_FFI_Error_Create_Args e = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, message,
                                 XLA_FFI_Error_Code_INVALID_ARGUMENT};
  return api->XLA_FFI_Error_Create(&e);
}

static void drop_error(const XLA_FFI_Api *api, XLA_FFI_Error *err) {
  XLA_FFI_Error_Destroy_Args d = {XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, NULL, err};
  api->XLA_FFI_Error_Destroy(&d);
}

/* Runs one item. */
typedef void (*item_fn)(const void *problem, int item);

/* A call's items, shared by the calling thread and the tasks it schedules, as `ranges` runs of consecutive items,
   one a thread: each thread takes its own run's items from the front, in order (a projection's weights are then one
   long stream a thread, which reads 3-7% faster than items alternating between threads: docs/cpu.md), then the
   other runs' from the back. claimed[r] counts run r's items taken either way; stolen[r] those from the back. The
   caller waits only for items another thread has claimed; a task that starts later finds none left (and never
   reads the problem, which lives on the caller's stack). The last of them to let go frees it. */
#define MAX_RANGES 64   /* threads a call runs on at most (memory bounds the projections long before) */
typedef struct {
  item_fn fn;
  const void *problem;
  int items, ranges;
  atomic_int joined, done, holders;
  atomic_int claimed[MAX_RANGES], stolen[MAX_RANGES];
} Work;

static void let_go(Work *w) {
  if (atomic_fetch_sub(&w->holders, 1) == 1) free(w);
}

/* Thread `id`'s share: its own run (id), then the others'. */
static void run_items(Work *w, int id) {
  for (int pass = 0; pass < w->ranges; pass++) {
    const int r = (id + pass) % w->ranges;
    const int lo = (int)((long long)r * w->items / w->ranges), hi = (int)((long long)(r + 1) * w->items / w->ranges);
    for (int own = 0; atomic_fetch_add(&w->claimed[r], 1) < hi - lo;) {
      const int i = pass == 0 ? lo + own++ : hi - 1 - atomic_fetch_add(&w->stolen[r], 1);
      w->fn(w->problem, i);
      atomic_fetch_add(&w->done, 1);
    }
  }
}

static void task(void *data) {
  Work *w = data;
  run_items(w, atomic_fetch_add(&w->joined, 1));
  let_go(w);
}

/* fn(problem, i) for i in [0, items), on the pool's threads and this one. */
static void run_parallel(const XLA_FFI_Api *api, XLA_FFI_ExecutionContext *ctx, item_fn fn, const void *problem,
                         int items) {
  int64_t threads = 1;
  XLA_FFI_ThreadPool_NumThreads_Args n = {XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE, NULL, ctx, &threads};
  XLA_FFI_Error *err = api->XLA_FFI_ThreadPool_NumThreads(&n);
  if (err) drop_error(api, err);
  Work *w = err || threads < 2 || items < 2 ? NULL : malloc(sizeof(Work));
  if (!w) {   /* no pool (or one thread, or one item): this thread runs them all */
    for (int i = 0; i < items; i++) fn(problem, i);
    return;
  }
  const int64_t most = threads < MAX_RANGES ? threads : MAX_RANGES;
  const int helpers = (int)(most < items ? most : items) - 1;
  w->fn = fn;
  w->problem = problem;
  w->items = items;
  w->ranges = 1 + helpers;
  atomic_init(&w->joined, 1);
  atomic_init(&w->done, 0);
  atomic_init(&w->holders, 1 + helpers);
  for (int r = 0; r < w->ranges; r++) {
    atomic_init(&w->claimed[r], 0);
    atomic_init(&w->stolen[r], 0);
  }
  for (int h = 0; h < helpers; h++) {
    XLA_FFI_ThreadPool_Schedule_Args t = {XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE, NULL, ctx, task, w};
    if ((err = api->XLA_FFI_ThreadPool_Schedule(&t))) {   /* not scheduled: its run falls to the others */
      drop_error(api, err);
      let_go(w);
    }
  }
  run_items(w, 0);
  while (atomic_load(&w->done) < items) sched_yield();
  let_go(w);
}

#endif
