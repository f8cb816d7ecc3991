/* The biased spin lock (src/lock.h): the first thread to take a lock owns
 * it and takes no lock word; another thread revokes the owner, and from
 * then on everyone takes the word; sections exclude each other through all
 * of it, a revocation in the middle of the owner's section included. CPU
 * only. ctest runs it twice: as is, and with CUBUF_LOCK_BIAS=0 (every lock
 * shared from the start). */
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"
#include "lock.h"

static bool bias; /* what this run expects: the environment and the kernel */

static bool expected_bias(void)
{
    const char *env = getenv("CUBUF_LOCK_BIAS");
    if (env && strcmp(env, "0") == 0) return false;
#ifdef SYS_membarrier
    long cmds = syscall(SYS_membarrier, 0 /* QUERY */, 0, 0);
    return cmds > 0 && (cmds & (1 << 3)) != 0; /* PRIVATE_EXPEDITED */
#else
    return false;
#endif
}

/* A section long enough to be caught in: a read, a pause of `spins`, a
 * write. Lost updates (and TSan reports) show a section that was not
 * exclusive. Returns whether it was entered as the owner. */
static bool section(cubuf_lock_t *l, uint64_t *counter, int spins)
{
    cubuf__lock(l);
    const bool owned = l->owned;
    uint64_t v = *counter;
    for (volatile int i = 0; i < spins; i++) {
    }
    *counter = v + 1;
    cubuf__unlock(l);
    return owned;
}

static void bump(cubuf_lock_t *l, uint64_t *counter) { (void)section(l, counter, 16); }

static void test_owner_takes_no_word(void)
{
    T_CHECK(cubuf__lock_bias_on() == bias);
    cubuf_lock_t l = {0};
    cubuf__lock(&l);
    if (bias) {
        T_CHECK(atomic_load(&l.owner) == cubuf__lock_self());
        T_CHECK(l.owned && atomic_load(&l.busy) && !atomic_load(&l.word));
    } else {
        T_CHECK(atomic_load(&l.owner) == CUBUF_LOCK_SHARED);
        T_CHECK(!l.owned && !atomic_load(&l.busy) && atomic_load(&l.word));
    }
    cubuf__unlock(&l);
    T_CHECK(!atomic_load(&l.busy) && !atomic_load(&l.word));
    cubuf__lock(&l); /* again: the same way */
    T_CHECK(l.owned == bias);
    cubuf__unlock(&l);
}

typedef struct job {
    cubuf_lock_t *lock;
    uint64_t *counter;
    atomic_int *go;
    int n;
    uintptr_t self;
    bool owned_first, owned_last; /* how its first and last sections were entered */
} job_t;

static void *worker(void *arg)
{
    job_t *j = arg;
    j->self = cubuf__lock_self();
    while (j->go && !atomic_load(j->go)) sched_yield();
    for (int i = 0; i < j->n; i++) {
        const bool owned = section(j->lock, j->counter, 16);
        if (i == 0) j->owned_first = owned;
        if (i == j->n - 1) j->owned_last = owned;
    }
    return NULL;
}

/* n workers of `iters` sections each on l, started together (go set). */
static void start_workers(job_t *jobs, pthread_t *th, int n, cubuf_lock_t *l, uint64_t *counter,
                          atomic_int *go, int iters)
{
    for (int i = 0; i < n; i++) {
        jobs[i] = (job_t){l, counter, go, iters, 0, false, false};
        T_CHECK(pthread_create(&th[i], NULL, worker, &jobs[i]) == 0);
    }
    atomic_store(go, 1);
}

/* Another thread's first section revokes the owner: it holds the word, the
 * lock is shared for good, the old owner takes the word too. */
static void test_revoke(void)
{
    cubuf_lock_t l = {0};
    uint64_t counter = 0;
    bump(&l, &counter);
    job_t j = {&l, &counter, NULL, 1, 0, true, true};
    pthread_t t;
    T_CHECK(pthread_create(&t, NULL, worker, &j) == 0);
    pthread_join(t, NULL);
    T_CHECK(!j.owned_first && j.self != cubuf__lock_self());
    T_CHECK(atomic_load(&l.owner) == CUBUF_LOCK_SHARED);
    cubuf__lock(&l);
    T_CHECK(!l.owned && atomic_load(&l.word));
    cubuf__unlock(&l);
    T_CHECK(!atomic_load(&l.word) && !atomic_load(&l.busy));
    bump(&l, &counter);
    T_CHECK(counter == 3);
}

/* Many rounds of: the main thread owns a fresh lock and runs sections while
 * three threads start at once; it goes on until one of its own sections
 * finds the lock revoked, so the revocation lands while it is at work. Its
 * sections are long (microseconds, longer than the revoking barrier), so
 * most revocations land in the middle of one, which the revoking thread
 * must wait out. Every increment must survive. */
static void test_exclusion_through_revocation(void)
{
    enum { ROUNDS = 60, THREADS = 3, N = 2000 };
    bool all_exact = true, revoked = true;
    for (int r = 0; r < ROUNDS; r++) {
        cubuf_lock_t l = {0};
        uint64_t counter = 0, mine = 0;
        atomic_int go = 0;
        bump(&l, &counter); /* main owns it (when biased) */
        job_t jobs[THREADS];
        pthread_t th[THREADS];
        start_workers(jobs, th, THREADS, &l, &counter, &go, N);
        for (bool owned = true; (owned || mine < 20) && mine < 100000000; mine++)
            owned = section(&l, &counter, 100000);
        for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
        if (counter != 1 + mine + (uint64_t)THREADS * N) all_exact = false;
        if (atomic_load(&l.owner) != CUBUF_LOCK_SHARED || mine >= 100000000) revoked = false;
        for (int i = 0; i < THREADS; i++)
            if (jobs[i].owned_first || jobs[i].owned_last) revoked = false;
    }
    T_CHECK(all_exact);
    T_CHECK(revoked);
}

/* The narrow windows: the owner runs short sections back to back while
 * another thread, started on a fresh lock each round, revokes it; the
 * revocation lands anywhere in the owner's loop, between its look at the
 * owner and its flag now and then. Thousands of rounds: every increment
 * must survive and every round must end (a breach can leave a flag set;
 * main's alarm ends a hang). */
typedef struct racer {
    cubuf_lock_t *lock;
    uint64_t *counter;
    atomic_int *go;
} racer_t;

static void *revoke_once(void *arg)
{
    racer_t *r = arg;
    while (!atomic_load(r->go)) {
    }
    cubuf__lock(r->lock);
    ++*r->counter;
    cubuf__unlock(r->lock);
    return NULL;
}

static void test_revocation_windows(void)
{
    enum { ROUNDS = 10000 };
    bool exact = true;
    for (int r = 0; r < ROUNDS && exact; r++) {
        cubuf_lock_t l = {0};
        uint64_t counter = 0, mine = 0;
        atomic_int go = 0;
        racer_t rc = {&l, &counter, &go};
        pthread_t t;
        bump(&l, &counter);
        T_CHECK(pthread_create(&t, NULL, revoke_once, &rc) == 0);
        atomic_store(&go, 1);
        for (bool owned = true; owned && mine < 50000000; mine++) {
            cubuf__lock(&l);
            owned = l.owned;
            ++counter;
            cubuf__unlock(&l);
        }
        pthread_join(t, NULL);
        if (counter != 2 + mine) exact = false;
    }
    T_CHECK(exact);
}

/* Threads that all start on a fresh lock: one may claim it, the rest revoke;
 * the total is exact either way. */
static void test_claim_race(void)
{
    enum { THREADS = 8, N = 3000 };
    for (int r = 0; r < 20; r++) {
        cubuf_lock_t l = {0};
        uint64_t counter = 0;
        atomic_int go = 0;
        job_t jobs[THREADS];
        pthread_t th[THREADS];
        start_workers(jobs, th, THREADS, &l, &counter, &go, N);
        int owners = 0;
        for (int i = 0; i < THREADS; i++) {
            pthread_join(th[i], NULL);
            owners += jobs[i].owned_first;
        }
        T_CHECK(counter == (uint64_t)THREADS * N);
        T_CHECK(owners <= (bias ? 1 : 0));
    }
}

/* An owner that has exited: a thread that comes with the same thread
 * pointer (glibc reuses a joined thread's) owns the lock after it; any
 * other thread revokes it. */
static void test_owner_exited(void)
{
    cubuf_lock_t l = {0};
    uint64_t counter = 0;
    job_t j = {&l, &counter, NULL, 5, 0, false, false};
    pthread_t t;
    T_CHECK(pthread_create(&t, NULL, worker, &j) == 0);
    pthread_join(t, NULL);
    T_CHECK(j.owned_first == bias && j.owned_last == bias);
    job_t k = {&l, &counter, NULL, 5, 0, true, true};
    T_CHECK(pthread_create(&t, NULL, worker, &k) == 0);
    pthread_join(t, NULL);
    const bool heir = k.self == j.self;
    T_CHECK(k.owned_first == (heir && bias) && k.owned_last == (heir && bias));
    T_CHECK(atomic_load(&l.owner) == (bias && heir ? k.self : CUBUF_LOCK_SHARED));
    bump(&l, &counter); /* the main thread: revokes whoever owns it */
    T_CHECK(!l.owned && counter == 11 && atomic_load(&l.owner) == CUBUF_LOCK_SHARED);
}

/* Two locks held at once (the caching resource's threshold change holds
 * every stream's), left in either order: each remembers how it was taken. */
static void test_two_held(void)
{
    cubuf_lock_t a = {0}, b = {0};
    uint64_t c = 0;
    job_t j = {&b, &c, NULL, 1, 0, false, false};
    pthread_t t;
    T_CHECK(pthread_create(&t, NULL, worker, &j) == 0); /* b: owned by another thread */
    pthread_join(t, NULL);
    cubuf__lock(&a);
    cubuf__lock(&b); /* revokes b's owner */
    T_CHECK(a.owned == bias && !b.owned);
    cubuf__unlock(&a);
    T_CHECK(atomic_load(&b.word));
    cubuf__unlock(&b);
    T_CHECK(!atomic_load(&a.busy) && !atomic_load(&a.word) && !atomic_load(&b.word));
}

/* A fork child: its one thread keeps the forking thread's pointer (and so its
 * locks); a thread it starts revokes one, which needs membarrier in the
 * child (registered again there). */
static void test_fork_child(void)
{
    cubuf_lock_t l = {0};
    uint64_t counter = 0;
    bump(&l, &counter);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        bump(&l, &counter);
        cubuf__lock(&l);
        const bool owned_in_child = l.owned;
        cubuf__unlock(&l);
        job_t j = {&l, &counter, NULL, 100, 0, true, true};
        pthread_t t;
        if (pthread_create(&t, NULL, worker, &j) != 0) _exit(3);
        bump(&l, &counter);
        pthread_join(t, NULL);
        bool ok = owned_in_child == bias && !j.owned_first && counter == 103 &&
                  atomic_load(&l.owner) == CUBUF_LOCK_SHARED;
        _exit(ok ? 0 : 1);
    }
    T_CHECK(pid > 0);
    int status = 0;
    T_CHECK(waitpid(pid, &status, 0) == pid);
    T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    cubuf__lock(&l); /* the parent still owns it */
    T_CHECK(l.owned == bias);
    cubuf__unlock(&l);
}

int main(void)
{
    alarm(300); /* a lock left held would hang a test: fail it instead */
    bias = expected_bias();
    printf("test_lock: locks %s\n", bias ? "biased (membarrier)" : "shared from the start");
    test_owner_takes_no_word();
    test_revoke();
    test_exclusion_through_revocation();
    test_revocation_windows();
    test_claim_race();
    test_owner_exited();
    test_two_held();
    test_fork_child();
    return t_finish("test_lock");
}
