// Would the GPU writing checked blocks straight into registered arena memory pay?
// (scripts/probe-arena-direct builds and runs this; results: docs/bench/gpu-runs.md, run 268.)
// Measures, on the lent host: (1) cudaHostRegister / Unregister of locked SysV-shm
// regions like the store's; (2) a kernel storing packed device-resident objects into
// registered host memory at 8-byte-aligned arena places (bump order within 64 KiB
// segments, and shuffled); (3) the installers' way: the CPU copying the same objects from
// a pinned buffer the GPU filled into the same places, 1 and 4 threads; (4) the round trip
// a two-phase slot adds: sizes to the host, places back, a launch, a sync.
#include <cuda_runtime.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/resource.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1);} } while (0)

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static double cpu_now() {
  struct rusage u; getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}

static uint8_t *shm_region(size_t size) {
  int id = shmget(IPC_PRIVATE, size, IPC_CREAT | 0600);
  if (id < 0) { perror("shmget"); exit(1); }
  void *p = shmat(id, nullptr, 0);
  if (p == (void *)-1) { perror("shmat"); exit(1); }
  shmctl(id, IPC_RMID, nullptr);
  if (mlock(p, size) != 0) perror("mlock");
  memset(p, 1, size);
  return (uint8_t *)p;
}

// One warp an object: 8-byte words from packed device memory to its arena place.
__global__ void scatter(const uint64_t *__restrict__ src, const uint32_t *__restrict__ src_word,
                        const uint32_t *__restrict__ words, uint64_t *const *__restrict__ dst, int n) {
  int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (warp >= n) return;
  const uint64_t *s = src + src_word[warp];
  uint64_t *d = dst[warp];
  for (uint32_t i = lane; i < words[warp]; i += 32) d[i] = s[i];
}

int main(int argc, char **argv) {
  const int SLOT = 2048;            // objects a slot
  const int SLOTS = 128;            // 262,144 objects: a GiB of pages
  const int N = SLOT * SLOTS;
  const size_t ARENA = 1ull << 30;  // place for them, cold between passes
  const int STREAMS = 4;
  int dev = 0;
  CK(cudaSetDevice(dev));
  int can_host_ptr = 0, pageable = 0;
  cudaDeviceGetAttribute(&can_host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, dev);
  cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccessUsesHostPageTables, dev);
  printf("attr can_use_host_pointer_for_registered %d pageable_uses_host_page_tables %d\n", can_host_ptr, pageable);

  // (1) registration cost.
  for (size_t kib : {64, 256, 2048, 3328, 8192, 65536, 262144, 1048576}) {
    size_t size = kib << 10;
    uint8_t *r = shm_region(size);
    double reg[3], unreg[3];
    for (int k = 0; k < 3; k++) {
      double t0 = now();
      CK(cudaHostRegister(r, size, cudaHostRegisterMapped));
      double t1 = now();
      CK(cudaHostUnregister(r));
      double t2 = now();
      reg[k] = t1 - t0; unreg[k] = t2 - t1;
    }
    std::sort(reg, reg + 3); std::sort(unreg, unreg + 3);
    printf("register %7zu KiB: register %.3f ms (%.2f ms/GiB), unregister %.3f ms (median of 3)\n",
           kib, reg[1] * 1e3, reg[1] * 1e3 * 1048576 / kib, unreg[1] * 1e3);
    munlock(r, size); shmdt(r);
  }

  // A slot's landing (3.25 MiB) as the pool hands it out: 52 separate 64 KiB blocks, each
  // registered and unregistered on its own (every other block of a region, so none adjoin).
  {
    const int BLOCKS = 52;
    uint8_t *r = shm_region(2 * BLOCKS * 65536);
    double t[5];
    for (int k = 0; k < 5; k++) {
      double a = now();
      for (int b = 0; b < BLOCKS; b++) CK(cudaHostRegister(r + 2 * b * 65536, 65536, cudaHostRegisterMapped));
      for (int b = 0; b < BLOCKS; b++) CK(cudaHostUnregister(r + 2 * b * 65536));
      t[k] = now() - a;
    }
    std::sort(t, t + 5);
    printf("a slot's landing as %d separate 64 KiB blocks: register + unregister %.3f ms (median of 5)\n", BLOCKS, t[2] * 1e3);
    munlock(r, 2 * BLOCKS * 65536); shmdt(r);
  }

  // Objects: lengths of a page compressed 1.3-20x plus the 4-byte checksum, rounded to 8.
  std::mt19937_64 rng(45);
  std::uniform_int_distribution<int> len_d(200, 3000);
  std::vector<uint32_t> words(N), src_word(N);
  uint64_t total_words = 0;
  for (int i = 0; i < N; i++) { words[i] = (len_d(rng) + 4 + 7) / 8; src_word[i] = 0; }
  // packed per slot (each slot's output starts at 0 of its own buffer region)
  std::vector<uint64_t> slot_base(SLOTS + 1, 0);
  for (int s = 0; s < SLOTS; s++) {
    uint32_t off = 0;
    for (int j = 0; j < SLOT; j++) { src_word[s * SLOT + j] = off; off += words[s * SLOT + j]; }
    slot_base[s + 1] = slot_base[s] + off;
    total_words += off;
  }
  double payload_gib = total_words * 8.0 / (1ull << 30);
  printf("objects %d, payload %.3f GiB (mean %.0f B)\n", N, payload_gib, total_words * 8.0 / N);

  uint8_t *arena = shm_region(ARENA);
  double t0 = now();
  CK(cudaHostRegister(arena, ARENA, cudaHostRegisterMapped));
  printf("arena 1 GiB registered in %.1f ms\n", (now() - t0) * 1e3);
  uint64_t *arena_dev = nullptr;
  CK(cudaHostGetDevicePointer((void **)&arena_dev, arena, 0));

  // Places: bump order, objects never across a 64 KiB segment; and shuffled (holes reused).
  const uint64_t SEG_WORDS = 65536 / 8;
  std::vector<uint64_t> bump(N);
  {
    uint64_t at = 0;
    for (int i = 0; i < N; i++) {
      if ((at % SEG_WORDS) + words[i] > SEG_WORDS) at = (at / SEG_WORDS + 1) * SEG_WORDS;
      bump[i] = at; at += words[i];
    }
    printf("bump places span %.3f GiB\n", at * 8.0 / (1ull << 30));
  }
  // Scattered: each object at a random 4 KiB place in the GiB (as holes reused all over).
  std::vector<uint64_t> scattered(N);
  {
    std::uniform_int_distribution<uint64_t> pick(0, ARENA / 4096 - 2);
    for (int i = 0; i < N; i++) scattered[i] = pick(rng) * 512 + (rng() % 4) * 8;  // in words
  }

  // Device side: packed objects, per-object metadata, destinations.
  uint64_t *src_d; CK(cudaMalloc(&src_d, total_words * 8));
  CK(cudaMemset(src_d, 0x5a, total_words * 8));
  uint32_t *words_d, *srcw_d; uint64_t **dst_d;
  CK(cudaMalloc(&words_d, N * 4)); CK(cudaMalloc(&srcw_d, N * 4)); CK(cudaMalloc(&dst_d, N * 8));
  CK(cudaMemcpy(words_d, words.data(), N * 4, cudaMemcpyHostToDevice));
  std::vector<uint32_t> srcw_abs(N);
  for (int s = 0; s < SLOTS; s++) for (int j = 0; j < SLOT; j++) srcw_abs[s * SLOT + j] = slot_base[s] + src_word[s * SLOT + j];
  CK(cudaMemcpy(srcw_d, srcw_abs.data(), N * 4, cudaMemcpyHostToDevice));
  cudaStream_t st[STREAMS];
  for (auto &s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  for (int layout = 0; layout < 2; layout++) {
    const std::vector<uint64_t> &place = layout ? scattered : bump;
    std::vector<uint64_t *> dst(N);
    for (int i = 0; i < N; i++) dst[i] = arena_dev + place[i];
    CK(cudaMemcpy(dst_d, dst.data(), N * 8, cudaMemcpyHostToDevice));
    double best[5];
    for (int rep = 0; rep < 5; rep++) {
      CK(cudaDeviceSynchronize());
      double a = now();
      for (int s = 0; s < SLOTS; s++) {
        int threads = 256, blocks = (SLOT * 32 + threads - 1) / threads;
        scatter<<<blocks, threads, 0, st[s % STREAMS]>>>(src_d, srcw_d + s * SLOT, words_d + s * SLOT, dst_d + s * SLOT, SLOT);
      }
      CK(cudaDeviceSynchronize());
      best[rep] = now() - a;
    }
    std::sort(best, best + 5);
    printf("gpu scatter into registered arena (%s): %.2f GB/s of payload, %.1f us a slot (median of 5, %d streams)\n",
           layout ? "scattered 4K places" : "bump in 64K segments", total_words * 8.0 / best[2] / 1e9,
           best[2] / SLOTS * 1e6 * STREAMS, STREAMS);
    // check a few objects landed
    int bad = 0;
    for (int i = 0; i < N; i += 997) {
      uint64_t *p = (uint64_t *)arena + place[i];
      for (uint32_t w = 0; w < words[i]; w++) if (p[w] != 0x5a5a5a5a5a5a5a5aull) { bad++; break; }
    }
    printf("  checked %d objects: %d wrong\n", N / 997 + 1, bad);
  }

  // (3) the installers' way: pinned results buffer (as the slot output) filled by the GPU,
  // then the CPU copies each object into its place. 1 and 4 threads.
  uint8_t *pinned; CK(cudaHostAlloc((void **)&pinned, total_words * 8, cudaHostAllocMapped));
  for (int layout = 0; layout < 2; layout++) {
    const std::vector<uint64_t> &place = layout ? scattered : bump;
    for (int threads : {1, 4}) {
      double wall[3], cpu[3];
      for (int rep = 0; rep < 3; rep++) {
        CK(cudaMemcpy(pinned, src_d, total_words * 8, cudaMemcpyDeviceToHost));
        memset(arena, 0, 64 << 20);  // push other lines out a little
        double c0 = cpu_now(), a = now();
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++)
          ts.emplace_back([&, t] {
            for (int s = t; s < SLOTS; s += threads)
              for (int j = 0; j < SLOT; j++) {
                int i = s * SLOT + j;
                memcpy(arena + place[i] * 8, pinned + (slot_base[s] + src_word[i]) * 8, words[i] * 8);
              }
          });
        for (auto &t : ts) t.join();
        wall[rep] = now() - a; cpu[rep] = cpu_now() - c0;
      }
      std::sort(wall, wall + 3); std::sort(cpu, cpu + 3);
      printf("cpu copy pinned->arena (%s), %d thread(s): %.2f GB/s, %.3f CPU-s per GiB of pages (%.3f per GiB of payload)\n",
             layout ? "scattered 4K places" : "bump in 64K segments", threads, total_words * 8.0 / wall[1] / 1e9,
             cpu[1] / 1.0, cpu[1] / payload_gib);
    }
  }

  // (4) the round trip a two-phase slot adds: 2048 sizes D2H, places computed, H2D, launch, sync.
  {
    uint32_t *sizes_h; uint64_t **dst_h;
    CK(cudaHostAlloc((void **)&sizes_h, SLOT * 4, 0)); CK(cudaHostAlloc((void **)&dst_h, SLOT * 8, 0));
    std::vector<double> lat;
    for (int rep = 0; rep < 200; rep++) {
      double a = now();
      CK(cudaMemcpyAsync(sizes_h, words_d, SLOT * 4, cudaMemcpyDeviceToHost, st[0]));
      CK(cudaStreamSynchronize(st[0]));
      uint64_t at = 0;
      for (int j = 0; j < SLOT; j++) { dst_h[j] = arena_dev + at; at += sizes_h[j]; }
      CK(cudaMemcpyAsync(dst_d, dst_h, SLOT * 8, cudaMemcpyHostToDevice, st[0]));
      scatter<<<(SLOT * 32 + 255) / 256, 256, 0, st[0]>>>(src_d, srcw_d, words_d, dst_d, SLOT);
      CK(cudaStreamSynchronize(st[0]));
      lat.push_back(now() - a);
    }
    std::sort(lat.begin(), lat.end());
    printf("two-phase slot round trip incl. one slot's scatter: p50 %.1f us, p90 %.1f us\n", lat[100] * 1e6, lat[180] * 1e6);
  }
  CK(cudaHostUnregister(arena));
  printf("done\n");
  return 0;
}
