"""C source of the probe's kernels: each is timed where it runs, with no interpreter in the loop."""

SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define LINE 64
#define WAIT_S 5

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static uint64_t next_rand(uint64_t *s) { /* xorshift64* */
    uint64_t x = *s;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    *s = x;
    return x * 2685821657736338717ULL;
}

void *volatile dlp_sink;
volatile double dlp_fsink;

static void *alloc_pages(size_t bytes) {
    size_t rounded = (bytes + 4095) / 4096 * 4096;
    void *p = NULL;
    if (posix_memalign(&p, 2u << 20, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

/* Dependent loads through one random cycle over every cache line of a `bytes` working set:
   each load's address comes from the previous load, so nothing overlaps and the prefetchers
   have no pattern to follow. Returns the best of `reps` in ns per load, or < 0 on failure. */
double dlp_chase(uint64_t bytes, uint64_t loads, int reps, uint64_t seed) {
    size_t n = (size_t)(bytes / LINE);
    if (n < 2 || reps < 1) return -1.0;
    char *mem = alloc_pages(n * LINE);
    size_t *order = malloc(n * sizeof(size_t));
    if (!mem || !order) { free(mem); free(order); return -2.0; }
    for (size_t i = 0; i < n; i++) order[i] = i;
    if (!seed) seed = 88172645463325252ULL;
    for (size_t i = n - 1; i > 0; i--) { /* Sattolo: a single cycle through all n lines */
        size_t j = (size_t)(next_rand(&seed) % i);
        size_t t = order[i]; order[i] = order[j]; order[j] = t;
    }
    for (size_t k = 0; k < n; k++) *(void **)(mem + k * LINE) = mem + order[k] * LINE;
    free(order);
    void **p = (void **)mem;
    for (size_t i = 0; i < n; i++) p = (void **)*p;
    uint64_t iters = loads / 16 + 1;
    double best = 1e300;
    for (int r = 0; r < reps; r++) {
        double t0 = now_ns();
        for (uint64_t i = 0; i < iters; i++) {
            p = (void **)*p; p = (void **)*p; p = (void **)*p; p = (void **)*p;
            p = (void **)*p; p = (void **)*p; p = (void **)*p; p = (void **)*p;
            p = (void **)*p; p = (void **)*p; p = (void **)*p; p = (void **)*p;
            p = (void **)*p; p = (void **)*p; p = (void **)*p; p = (void **)*p;
        }
        double dt = now_ns() - t0;
        if (dt < best) best = dt;
    }
    dlp_sink = p;
    free(mem);
    return best / (double)(iters * 16);
}

/* A chain of dependent double additions (no -ffast-math, so the compiler keeps the chain). */
double dlp_fadd_latency(uint64_t ops, int reps) {
    double best = 1e300, x = dlp_fsink + 1.0;
    const double b = 1e-9;
    uint64_t iters = ops / 8 + 1;
    for (int r = 0; r < reps; r++) {
        double t0 = now_ns();
        for (uint64_t i = 0; i < iters; i++) {
            x += b; x += b; x += b; x += b; x += b; x += b; x += b; x += b;
        }
        double dt = now_ns() - t0;
        if (dt < best) best = dt;
    }
    dlp_fsink = x;
    return best / (double)(iters * 8);
}

/* Uncontended lock + unlock pairs, ns per pair. */
double dlp_mutex(uint64_t iters, int reps) {
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    double best = 1e300;
    for (int r = 0; r < reps; r++) {
        double t0 = now_ns();
        for (uint64_t i = 0; i < iters; i++) {
            pthread_mutex_lock(&m);
            pthread_mutex_unlock(&m);
        }
        double dt = now_ns() - t0;
        if (dt < best) best = dt;
    }
    pthread_mutex_destroy(&m);
    return best / (double)iters;
}

typedef struct {
    pthread_mutex_t m;
    pthread_cond_t c;
    int turn, failed, stop;
    uint64_t rounds;
} pingpong;

/* Called with s->m held; every wait is bounded, so a lost partner ends the run instead of hanging. */
static int wait_turn(pingpong *s, int me) {
    while (s->turn != me && !s->failed && !s->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += WAIT_S;
        if (pthread_cond_timedwait(&s->c, &s->m, &ts) == ETIMEDOUT && s->turn != me) {
            s->failed = 1;
            pthread_cond_broadcast(&s->c);
        }
    }
    return !s->failed && !s->stop;
}

static void *pong(void *arg) {
    pingpong *s = arg;
    pthread_mutex_lock(&s->m);
    for (uint64_t i = 0; i < s->rounds; i++) {
        if (!wait_turn(s, 1)) break;
        s->turn = 0;
        pthread_cond_broadcast(&s->c);
    }
    pthread_mutex_unlock(&s->m);
    return NULL;
}

/* Two threads hand a token back and forth through a mutex and condition variable: ns per one-way
   hand-off over the rounds done, stopping early after max_s seconds (a busy machine makes each
   hand-off wait for a time slice); < 0 on failure. */
double dlp_handoff(uint64_t rounds, double max_s) {
    pingpong s;
    pthread_mutex_init(&s.m, NULL);
    pthread_cond_init(&s.c, NULL);
    s.turn = 0; s.failed = 0; s.stop = 0; s.rounds = rounds;
    pthread_t t;
    if (rounds == 0 || pthread_create(&t, NULL, pong, &s) != 0) return -1.0;
    double t0 = now_ns(), end = t0 + max_s * 1e9;
    uint64_t done = 0;
    pthread_mutex_lock(&s.m);
    while (done < rounds) {
        s.turn = 1;
        pthread_cond_broadcast(&s.c);
        if (!wait_turn(&s, 0)) break;
        done++;
        if ((done & 63) == 0 && now_ns() > end) break;
    }
    double dt = now_ns() - t0;
    s.stop = 1;
    pthread_cond_broadcast(&s.c);
    pthread_mutex_unlock(&s.m);
    pthread_join(t, NULL);
    int failed = s.failed || done == 0;
    pthread_cond_destroy(&s.c);
    pthread_mutex_destroy(&s.m);
    return failed ? -2.0 : dt / (2.0 * (double)done);
}

/* ---- the same hand-off by spinning on one shared cache line: what moving a modified line between
   cores costs, with no sleeping. A spinner checks the clock now and then and gives up after WAIT_S. ---- */
typedef struct {
    volatile int turn __attribute__((aligned(64)));
    volatile int failed, stop;
    uint64_t rounds;
} spinpair;

static int spin_until(spinpair *s, int me) {
    uint64_t spins = 0;
    double deadline = 0.0;
    while (__atomic_load_n(&s->turn, __ATOMIC_ACQUIRE) != me) {
        if (s->failed || s->stop) return 0;
        if ((++spins & 4095) == 0) {
            double t = now_ns();
            if (deadline == 0.0) deadline = t + WAIT_S * 1e9;
            else if (t > deadline) { s->failed = 1; return 0; }
        }
    }
    return 1;
}

static void *spin_partner(void *arg) {
    spinpair *s = arg;
    for (uint64_t i = 0; i < s->rounds; i++) {
        if (!spin_until(s, 1)) break;
        __atomic_store_n(&s->turn, 0, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* ns per one-way hand-off of a spun-on cache line over the rounds done in at most about max_s
   seconds, or < 0 on failure. */
double dlp_spin_handoff(uint64_t rounds, double max_s) {
    spinpair *s = aligned_alloc(64, sizeof(spinpair));
    if (!s) return -1.0;
    s->turn = 0; s->failed = 0; s->stop = 0; s->rounds = rounds;
    pthread_t t;
    if (rounds == 0 || pthread_create(&t, NULL, spin_partner, s) != 0) { free(s); return -1.0; }
    double t0 = now_ns(), end = t0 + max_s * 1e9;
    uint64_t done = 0;
    while (done < rounds) {
        __atomic_store_n(&s->turn, 1, __ATOMIC_RELEASE);
        if (!spin_until(s, 0)) break;
        done++;
        if ((done & 255) == 0 && now_ns() > end) break;
    }
    double dt = now_ns() - t0;
    __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
    pthread_join(t, NULL);
    int failed = s->failed || done == 0;
    free(s);
    return failed ? -2.0 : dt / (2.0 * (double)rounds);
}

/* ---- STREAM: copy, scale, add, triad over three arrays of n doubles, split across threads ---- */
typedef struct {
    double *a, *b, *c;
    size_t lo, hi;
    int reps, timer;
    pthread_barrier_t *bar;
    double best[4];
} stream_part;

static void stream_kernel(int k, const stream_part *p) {
    double *restrict a = p->a, *restrict b = p->b, *restrict c = p->c;
    const double s = 3.0;
    size_t lo = p->lo, hi = p->hi;
    switch (k) {
    case 0: for (size_t j = lo; j < hi; j++) c[j] = a[j]; break;
    case 1: for (size_t j = lo; j < hi; j++) b[j] = s * c[j]; break;
    case 2: for (size_t j = lo; j < hi; j++) c[j] = a[j] + b[j]; break;
    default: for (size_t j = lo; j < hi; j++) a[j] = b[j] + s * c[j]; break;
    }
}

static void *stream_run(void *arg) {
    stream_part *p = arg;
    for (size_t j = p->lo; j < p->hi; j++) { p->a[j] = 1.0; p->b[j] = 2.0; p->c[j] = 0.0; }
    for (int k = 0; k < 4; k++) p->best[k] = 1e300;
    for (int r = 0; r < p->reps; r++) {
        for (int k = 0; k < 4; k++) {
            pthread_barrier_wait(p->bar);
            double t0 = now_ns();
            stream_kernel(k, p);
            pthread_barrier_wait(p->bar);  /* the timer sees every thread's share finished */
            double dt = now_ns() - t0;
            if (dt < p->best[k]) p->best[k] = dt;
        }
    }
    return NULL;
}

/* Best ns per kernel (copy, scale, add, triad) into best_ns[4]; 0 on success. */
int dlp_stream(uint64_t n, int reps, int nthreads, double *best_ns) {
    if (nthreads < 1 || nthreads > 256 || reps < 1 || n < (uint64_t)nthreads) return -1;
    double *a = alloc_pages(n * sizeof(double));
    double *b = alloc_pages(n * sizeof(double));
    double *c = alloc_pages(n * sizeof(double));
    stream_part *parts = calloc((size_t)nthreads, sizeof(stream_part));
    pthread_t *threads = calloc((size_t)nthreads, sizeof(pthread_t));
    pthread_barrier_t bar;
    int rc = 0, started = 0;
    if (!a || !b || !c || !parts || !threads) { rc = -2; goto done; }
    pthread_barrier_init(&bar, NULL, (unsigned)nthreads);
    for (int t = 0; t < nthreads; t++) {
        parts[t] = (stream_part){a, b, c, n * t / nthreads, n * (t + 1) / nthreads, reps, t == 0, &bar, {0}};
    }
    for (started = 1; started < nthreads; started++) {
        if (pthread_create(&threads[started], NULL, stream_run, &parts[started]) != 0) break;
    }
    if (started < nthreads) {
        /* the barrier counts on every thread: without all of them nobody may start */
        rc = -3;
        pthread_barrier_destroy(&bar);
        pthread_barrier_init(&bar, NULL, 1);
        for (int t = 1; t < started; t++) pthread_cancel(threads[t]);
        for (int t = 1; t < started; t++) pthread_join(threads[t], NULL);
        pthread_barrier_destroy(&bar);
        goto done;
    }
    stream_run(&parts[0]);
    for (int t = 1; t < nthreads; t++) pthread_join(threads[t], NULL);
    pthread_barrier_destroy(&bar);
    for (int k = 0; k < 4; k++) best_ns[k] = parts[0].best[k];
done:
    free(a); free(b); free(c); free(parts); free(threads);
    return rc;
}

/* ---- storage: pread of `block` bytes, sequential or at random block-aligned offsets ---- */
double dlp_pread(int fd, uint64_t file_bytes, uint32_t block, uint64_t count, int random_offsets, uint64_t seed) {
    if (block == 0 || file_bytes < block || count == 0) return -1.0;
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, block) != 0) return -2.0;
    uint64_t blocks = file_bytes / block;
    if (!seed) seed = 0x9E3779B97F4A7C15ULL;
    double t0 = now_ns();
    for (uint64_t i = 0; i < count; i++) {
        uint64_t idx = random_offsets ? next_rand(&seed) % blocks : i % blocks;
        ssize_t got = pread(fd, buf, block, (off_t)(idx * block));
        if (got != (ssize_t)block) { free(buf); return got < 0 ? -1000.0 - errno : -3.0; }
    }
    double dt = now_ns() - t0;
    free(buf);
    return dt / (double)count;
}

/* ---- loopback TCP on 127.0.0.1, every call bounded by WAIT_S socket timeouts ---- */
static void set_timeouts(int fd) {
    struct timeval tv = {WAIT_S, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int tcp_pair(int *client, int *server) {
    struct sockaddr_in addr;
    socklen_t len = sizeof addr;
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0) return -1;
    set_timeouts(lfd);
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(lfd, 1) != 0
        || getsockname(lfd, (struct sockaddr *)&addr, &len) != 0) { close(lfd); return -2; }
    int cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (cfd < 0) { close(lfd); return -3; }
    set_timeouts(cfd);
    if (connect(cfd, (struct sockaddr *)&addr, sizeof addr) != 0) { close(cfd); close(lfd); return -4; }
    int sfd = accept(lfd, NULL, NULL);
    close(lfd);
    if (sfd < 0) { close(cfd); return -5; }
    set_timeouts(sfd);
    *client = cfd; *server = sfd;
    return 0;
}

static int send_all(int fd, const char *buf, size_t n) {
    while (n) {
        ssize_t k = send(fd, buf, n, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        buf += k; n -= (size_t)k;
    }
    return 0;
}

static int recv_all(int fd, char *buf, size_t n) {
    while (n) {
        ssize_t k = recv(fd, buf, n, 0);
        if (k <= 0) return -1;
        buf += k; n -= (size_t)k;
    }
    return 0;
}

typedef struct {
    int fd, failed;
    uint32_t msg;
    uint64_t received;
    double end_ns;
} tcp_peer;

/* Receives until the sender shuts its side down (EOF); a timeout or error marks the run failed. */
static void *drain(void *arg) {
    tcp_peer *p = arg;
    char buf[65536];
    for (;;) {
        ssize_t k = recv(p->fd, buf, sizeof buf, 0);
        if (k == 0) break;
        if (k < 0) { p->failed = 1; break; }
        p->received += (uint64_t)k;
    }
    p->end_ns = now_ns();
    return NULL;
}

/* Echoes whole messages until the client goes away; the client checks every echo itself. */
static void *echo(void *arg) {
    tcp_peer *p = arg;
    char *buf = malloc(p->msg);
    if (!buf) { p->failed = 1; return NULL; }
    while (recv_all(p->fd, buf, p->msg) == 0 && send_all(p->fd, buf, p->msg) == 0) {}
    free(buf);
    return NULL;
}

/* mode 0: stream up to `count` messages of `msg` bytes one way, ns per message until the receiver
   has them all; mode 1: up to `count` request/echo round trips of `msg` bytes, ns per round trip.
   Either stops after about max_s seconds with the messages done so far. */
double dlp_tcp(int mode, uint64_t count, uint32_t msg, double max_s) {
    if (count == 0 || msg == 0 || msg > (1u << 24)) return -1.0;
    int cfd, sfd;
    int rc = tcp_pair(&cfd, &sfd);
    if (rc) return -10.0 + rc;
    char *buf = calloc(1, msg);
    tcp_peer peer = {sfd, 0, msg, 0, 0.0};
    pthread_t t;
    if (!buf || pthread_create(&t, NULL, mode ? echo : drain, &peer) != 0) {
        free(buf); close(cfd); close(sfd); return -3.0;
    }
    int failed = 0;
    uint64_t done = 0;
    double t0 = now_ns(), end = t0 + max_s * 1e9, t1;
    while (done < count && !failed) {
        failed = send_all(cfd, buf, msg) != 0;
        if (mode && !failed) failed = recv_all(cfd, buf, msg) != 0;
        if (!failed) done++;
        if ((done & 63) == 0 && now_ns() > end) break;
    }
    t1 = now_ns();
    shutdown(cfd, SHUT_WR);  /* the receiver sees EOF once it has drained everything sent */
    pthread_join(t, NULL);
    close(cfd); close(sfd); free(buf);
    if (failed || peer.failed || done == 0) return -4.0;
    if (mode) return (t1 - t0) / (double)done;
    if (peer.received != done * msg) return -5.0;
    return (peer.end_ns - t0) / (double)done;
}
"""
