/* The biased spin lock's slow paths (lock.h says how it works): claiming
 * a lock, taking its word, revoking its owner. */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lock.h"

/* membarrier(2)'s commands (linux/membarrier.h), spelled out so the build
 * needs no kernel headers. */
#define MB_CMD_QUERY 0
#define MB_CMD_GLOBAL 1
#define MB_CMD_PRIVATE_EXPEDITED (1 << 3)
#define MB_CMD_REGISTER_PRIVATE_EXPEDITED (1 << 4)

static long membarrier(int cmd)
{
#ifdef SYS_membarrier
    return syscall(SYS_membarrier, cmd, 0, 0);
#else
    (void)cmd;
    return -1;
#endif
}

uintptr_t cubuf__lock_self_slow(void) { return (uintptr_t)pthread_self(); }

/* ---- whether locks are biased ---------------------------------------------- */

static bool bias_on;
static pthread_once_t bias_once = PTHREAD_ONCE_INIT;

static bool register_barrier(void) { return membarrier(MB_CMD_REGISTER_PRIVATE_EXPEDITED) == 0; }

/* A fork child registers again: harmless where the registration carries
 * over (it should), needed where it does not. */
static void child_registers(void) { (void)register_barrier(); }

static void bias_init(void)
{
    const char *env = getenv("CUBUF_LOCK_BIAS");
    if (env && strcmp(env, "0") == 0) return;
    const long cmds = membarrier(MB_CMD_QUERY);
    if (cmds < 0 || !(cmds & MB_CMD_PRIVATE_EXPEDITED) || !register_barrier()) return;
    if (pthread_atfork(NULL, NULL, child_registers) != 0) return;
    bias_on = true;
}

bool cubuf__lock_bias_on(void)
{
    pthread_once(&bias_once, bias_init);
    return bias_on;
}

/* At load (CUBUF_LOCK_BIAS is read then): registering with membarrier
 * waits for an RCU grace period (about 10 ms, measured) once the process
 * has several threads, as it has after cuInit; a program that links cubuf
 * is usually still single-threaded when it loads, and registration is then
 * immediate. */
__attribute__((constructor)) static void bias_at_load(void) { (void)cubuf__lock_bias_on(); }

/* ---- the slow paths ------------------------------------------------------------ */

static void spin_until_clear(atomic_bool *flag)
{
    unsigned spins = 0;
    while (atomic_load_explicit(flag, memory_order_acquire)) {
        if (++spins < 256) cubuf__cpu_relax();
        else sched_yield(); /* the holder may have been preempted */
    }
}

static void take_word(cubuf_lock_t *l)
{
    while (atomic_exchange_explicit(&l->word, true, memory_order_acquire)) spin_until_clear(&l->word);
}

/* Every thread of the process passes a full memory barrier before this
 * returns. Registered at bias_init (and in a fork child); the global
 * command, slower, needs no registration. A process that cannot do either
 * cannot revoke an owner safely, and stops. */
static void process_barrier(void)
{
    if (membarrier(MB_CMD_PRIVATE_EXPEDITED) == 0 || membarrier(MB_CMD_GLOBAL) == 0) return;
    fputs("cubuf: membarrier(2) failed while revoking a lock's owner; stopping\n", stderr);
    abort();
}

bool cubuf__lock_slow(cubuf_lock_t *l)
{
    const uintptr_t self = cubuf__lock_self();
    uintptr_t o = atomic_load_explicit(&l->owner, memory_order_relaxed);
    if (o == 0 && cubuf__lock_bias_on() &&
        atomic_compare_exchange_strong_explicit(&l->owner, &o, self, memory_order_relaxed,
                                                memory_order_relaxed))
        o = self;
    if (o == self && cubuf__lock_enter_owned(l, self)) return true;
    take_word(l);
    /* Looked at again with the word held: revokers come one at a time. */
    o = atomic_load_explicit(&l->owner, memory_order_relaxed);
    if (o != CUBUF_LOCK_SHARED) {
        atomic_store_explicit(&l->owner, CUBUF_LOCK_SHARED, memory_order_seq_cst);
        if (o != 0) { /* an owner may be in a section, or about to enter one */
            process_barrier();
            spin_until_clear(&l->busy); /* acquiring: its section happened before ours */
        }
    }
    return false;
}
