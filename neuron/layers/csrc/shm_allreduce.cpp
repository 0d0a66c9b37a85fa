// The sum all-reduce of ranks on one host, through a shared memory segment (neuron/distributed/shm.py).
//
// The segment: a header line, one flag line per rank, then two buffers of `world` slots of
// `slot_bytes` each. Call k of a rank uses buffer k & 1: it copies its tensor into its slot of that
// buffer, publishes k in its flag (a release store), waits until every rank's flag reached k (an
// acquire load), and sums the slots into its tensor in rank order, so every rank computes the same
// bits. Rank r writes its slot of buffer k & 1 again only at call k + 2, after every rank published
// k + 1, that is after every rank finished reading call k: one barrier per call, no second one.
//
// Waiting spins on the flag for up to 50 us (a collective's ranks arrive within microseconds of each
// other when the step's work is even), then sleeps on it with futex. A writer wakes sleepers only when
// the header says some exist: the fast path makes no system call. A wait ends at its deadline, at the
// segment's abort word (any rank, or the leader, sets it when a rank is lost) or at the calling
// process's own abort word, and says which.
//
// A tensor larger than a slot goes through in pieces, a call each.
//
// The gather to rank 0 (the logits of a vocabulary split) uses the same slots and sequence: each other
// rank copies its part into its slot and publishes; only rank 0 waits, and copies every part out. As
// the other ranks do not wait in a gather, every call first waits until each rank published the call
// before it, that is finished reading the call before that, whose buffer this call writes again (for
// an all-reduce after an all-reduce it holds already, a load per rank).

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define NEURON_PAUSE() _mm_pause()
#else
#define NEURON_PAUSE() ((void)0)
#endif

namespace {

constexpr uint32_t MAGIC = 0x6e534852;  // "nSHR"
constexpr int MAX_RANKS = 64;
constexpr int LINE = 64;
constexpr int64_t SPIN_NS = 50'000;         // how long a wait spins before it sleeps
constexpr int64_t SLEEP_NS = 2'000'000;    // one futex sleep at most: the deadline and abort words are read between

enum Status : int { OK = 0, TIMED_OUT = 1, ABORTED = 2, BAD_SEGMENT = 3 };
enum DType : int { F32 = 0, BF16 = 1 };

struct alignas(LINE) Header {
    uint32_t magic;
    uint32_t world;
    uint64_t slot_bytes;
    std::atomic<uint32_t> aborted;
    std::atomic<uint32_t> sleepers;
};

struct alignas(LINE) Flag {
    std::atomic<uint32_t> seq;  // the last call this rank published
    uint32_t calls;             // the calls this rank made (its own line: no one else writes it)
};

static_assert(sizeof(Header) == LINE && sizeof(Flag) == LINE, "one cache line each");

constexpr int64_t data_offset() { return ((sizeof(Header) + MAX_RANKS * sizeof(Flag)) + 4095) / 4096 * 4096; }

inline Header* header(void* seg) { return static_cast<Header*>(seg); }
inline Flag* flag(void* seg, int rank) { return reinterpret_cast<Flag*>(static_cast<char*>(seg) + sizeof(Header)) + rank; }
inline char* slot(void* seg, int buf, int rank) {
    const Header* h = header(seg);
    return static_cast<char*>(seg) + data_offset() + (int64_t(buf) * h->world + rank) * int64_t(h->slot_bytes);
}

inline int64_t now_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

inline bool reached(uint32_t value, uint32_t seq) { return int32_t(value - seq) >= 0; }  // wraps safely

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ns) {
    timespec t{time_t(ns / 1'000'000'000), long(ns % 1'000'000'000)};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &t, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int wait_for(void* seg, int rank, uint32_t seq, int64_t deadline, const std::atomic<uint32_t>* local_abort) {
    Header* h = header(seg);
    std::atomic<uint32_t>& word = flag(seg, rank)->seq;
    const int64_t spin_until = now_ns() + SPIN_NS;
    for (int i = 1;; ++i) {
        if (reached(word.load(std::memory_order_acquire), seq)) return OK;
        NEURON_PAUSE();
        if (i % 64 == 0 && now_ns() > spin_until) break;
    }
    for (;;) {
        if (h->aborted.load(std::memory_order_relaxed) || local_abort->load(std::memory_order_relaxed)) return ABORTED;
        const int64_t left = deadline - now_ns();
        if (left <= 0) return TIMED_OUT;
        h->sleepers.fetch_add(1, std::memory_order_seq_cst);
        const uint32_t seen = word.load(std::memory_order_seq_cst);
        if (!reached(seen, seq)) futex_wait(&word, seen, left < SLEEP_NS ? left : SLEEP_NS);
        h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
        if (reached(word.load(std::memory_order_acquire), seq)) return OK;
    }
}

// Whether `seg` holds a header this build wrote, with `rank` among its ranks.
inline bool usable(const Header* h, int rank) {
    const int world = int(h->world);
    return h->magic == MAGIC && world >= 2 && world <= MAX_RANKS && rank >= 0 && rank < world;
}

// This rank's slot for call `seq` is written (and its reads of the calls before done): say so, and
// wake the ranks sleeping on the flag, if the header says any are.
inline void publish(Header* h, Flag* mine, uint32_t seq) {
    mine->seq.store(seq, std::memory_order_seq_cst);
    if (h->sleepers.load(std::memory_order_seq_cst)) futex_wake(&mine->seq);
}

// Until every other rank published `seq`.
int wait_all(void* seg, int rank, int world, uint32_t seq, int64_t deadline, const std::atomic<uint32_t>* local_abort) {
    for (int r = 0; r < world; ++r) {
        if (r == rank) continue;
        const int status = wait_for(seg, r, seq, deadline, local_abort);
        if (status != OK) return status;
    }
    return OK;
}

inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; a NaN stays a NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

// out[i] = sum over ranks, in rank order, of slot r's element i.
void sum_f32(void* seg, int buf, int world, float* out, int64_t n, int threads) {
    const float* src[MAX_RANKS];
    for (int r = 0; r < world; ++r) src[r] = reinterpret_cast<const float*>(slot(seg, buf, r));
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= (1 << 16) && threads > 1)
    for (int64_t start = 0; start < n; start += 4096) {
        const int64_t stop = start + 4096 < n ? start + 4096 : n;
#pragma omp simd
        for (int64_t i = start; i < stop; ++i) out[i] = src[0][i] + src[1][i];
        for (int r = 2; r < world; ++r) {
            const float* s = src[r];
#pragma omp simd
            for (int64_t i = start; i < stop; ++i) out[i] += s[i];
        }
    }
}

void sum_bf16(void* seg, int buf, int world, uint16_t* out, int64_t n, int threads) {
    const uint16_t* src[MAX_RANKS];
    for (int r = 0; r < world; ++r) src[r] = reinterpret_cast<const uint16_t*>(slot(seg, buf, r));
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= (1 << 16) && threads > 1)
    for (int64_t start = 0; start < n; start += 4096) {
        const int64_t stop = start + 4096 < n ? start + 4096 : n;
        float acc[4096];
#pragma omp simd
        for (int64_t i = start; i < stop; ++i) acc[i - start] = bf16_to_f32(src[0][i]) + bf16_to_f32(src[1][i]);
        for (int r = 2; r < world; ++r) {
            const uint16_t* s = src[r];
#pragma omp simd
            for (int64_t i = start; i < stop; ++i) acc[i - start] += bf16_to_f32(s[i]);
        }
#pragma omp simd
        for (int64_t i = start; i < stop; ++i) out[i] = f32_to_bf16(acc[i - start]);
    }
}

}  // namespace

extern "C" {

// Bytes a segment of `world` ranks with slots of `slot_bytes` takes.
int64_t neuron_shm_segment_bytes(int world, int64_t slot_bytes) { return data_offset() + 2 * world * slot_bytes; }

// Rank 0 writes the header of a zeroed segment before any other rank attaches.
void neuron_shm_init(void* seg, int world, int64_t slot_bytes) {
    Header* h = header(seg);
    h->world = uint32_t(world);
    h->slot_bytes = uint64_t(slot_bytes);
    h->aborted.store(0);
    h->sleepers.store(0);
    for (int r = 0; r < world; ++r) {
        flag(seg, r)->seq.store(0);
        flag(seg, r)->calls = 0;
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    h->magic = MAGIC;
}

// Whether an attached segment is one this build wrote for `world` ranks and `slot_bytes`.
int neuron_shm_check(void* seg, int world, int64_t slot_bytes) {
    const Header* h = header(seg);
    return h->magic == MAGIC && h->world == uint32_t(world) && h->slot_bytes == uint64_t(slot_bytes);
}

// Sum `n` elements at `data` (dtype F32 or BF16) across the segment's ranks, in place. Returns OK,
// TIMED_OUT (a rank did not arrive within `timeout_ms`), ABORTED or BAD_SEGMENT. After anything but OK
// the segment is unusable: the ranks are rebuilt.
int neuron_shm_all_reduce(void* seg, int rank, void* data, int64_t n, int dtype, int64_t timeout_ms,
                          const uint32_t* local_abort, int threads) {
    Header* h = header(seg);
    const int world = int(h->world);
    if (!usable(h, rank)) return BAD_SEGMENT;
    const auto* abort_word = reinterpret_cast<const std::atomic<uint32_t>*>(local_abort);
    const int64_t size = dtype == BF16 ? 2 : 4;
    const int64_t per_call = int64_t(h->slot_bytes) / size;
    const int64_t deadline = now_ns() + timeout_ms * 1'000'000;
    Flag* mine = flag(seg, rank);
    char* bytes = static_cast<char*>(data);
    for (int64_t done = 0; done < n; done += per_call) {
        const int64_t count = n - done < per_call ? n - done : per_call;
        const uint32_t seq = ++mine->calls;
        const int buf = int(seq & 1u);
        const int ready = wait_all(seg, rank, world, seq - 1, deadline, abort_word);
        if (ready != OK) return ready;
        std::memcpy(slot(seg, buf, rank), bytes + done * size, size_t(count * size));
        publish(h, mine, seq);
        const int status = wait_all(seg, rank, world, seq, deadline, abort_word);
        if (status != OK) return status;
        if (dtype == BF16)
            sum_bf16(seg, buf, world, reinterpret_cast<uint16_t*>(bytes + done * size), count, threads);
        else
            sum_f32(seg, buf, world, reinterpret_cast<float*>(bytes + done * size), count, threads);
    }
    return OK;
}

// Gather `n` bytes at `data` from every rank to rank 0, which gets rank r's at `out` + r * n (`out` is
// unused on the others). Returns as neuron_shm_all_reduce does.
int neuron_shm_gather(void* seg, int rank, const void* data, int64_t n, void* out, int64_t timeout_ms,
                      const uint32_t* local_abort) {
    Header* h = header(seg);
    const int world = int(h->world);
    if (!usable(h, rank)) return BAD_SEGMENT;
    const auto* abort_word = reinterpret_cast<const std::atomic<uint32_t>*>(local_abort);
    const int64_t per_call = int64_t(h->slot_bytes);
    const int64_t deadline = now_ns() + timeout_ms * 1'000'000;
    Flag* mine = flag(seg, rank);
    const char* bytes = static_cast<const char*>(data);
    char* gathered = static_cast<char*>(out);
    if (rank == 0) std::memcpy(gathered, bytes, size_t(n));
    for (int64_t done = 0; done < n; done += per_call) {
        const int64_t count = n - done < per_call ? n - done : per_call;
        const uint32_t seq = ++mine->calls;
        const int buf = int(seq & 1u);
        const int ready = wait_all(seg, rank, world, seq - 1, deadline, abort_word);
        if (ready != OK) return ready;
        if (rank != 0) std::memcpy(slot(seg, buf, rank), bytes + done, size_t(count));
        publish(h, mine, seq);
        if (rank != 0) continue;
        const int status = wait_all(seg, rank, world, seq, deadline, abort_word);
        if (status != OK) return status;
        for (int r = 1; r < world; ++r) std::memcpy(gathered + r * n + done, slot(seg, buf, r), size_t(count));
    }
    return OK;
}

// Ends every rank's wait on the segment (a rank was lost, or the ranks are being torn down).
void neuron_shm_abort(void* seg) {
    Header* h = header(seg);
    h->aborted.store(1, std::memory_order_seq_cst);
    const int world = int(h->world) <= MAX_RANKS ? int(h->world) : MAX_RANKS;
    for (int r = 0; r < world; ++r) futex_wake(&flag(seg, r)->seq);
}

}  // extern "C"
