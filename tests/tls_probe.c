/* What tests/check_tls.sh must refuse (test_tls_reads_probe): a thread-local
 * accessor the compiler may see into (noinline without noipa, so GCC's
 * interprocedural register allocation learns it keeps vector registers),
 * and a caller that keeps two across its call. Built at -O2 with TLS
 * descriptors, as an object only: never linked. */
double cubuf_tls_probe_kept(double a, double b);

static _Thread_local int probe_tls;
static __attribute__((noinline)) int *probe_slot(void) { return &probe_tls; }

double cubuf_tls_probe_kept(double a, double b)
{
    const double c = a * b;
    *probe_slot() = 1;
    return c + a;
}
