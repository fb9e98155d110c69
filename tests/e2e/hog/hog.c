/*
 * hog: fill SIZE MiB of anonymous memory with non-zero, compressible, text-like data,
 * then read every 8-byte word back and compare it with a regenerated copy.
 * Used by the swap scenarios to push pages through a swap device and catch corruption.
 *
 *   hog MIB [PASSES [HOLD]]   PASSES verify passes after the fill (default 1); HOLD seconds
 *                             to sleep between the fill and the first verify pass (while
 *                             the filled pages sit in swap), announced by "hog: holding"
 *   hog -t SECS MIB ...       the same in a child, killed (SIGKILL) after SECS by a parent
 *                             whose memory is locked; exits as the child did, 137 if killed.
 *                             `timeout -s KILL` could not kill a hog on a swap device that
 *                             refuses writes: timeout's own pages were in swap, and its
 *                             swap-in stalled in reclaim for good (scenario l, 7.3).
 *
 * Every page is one of 256 text-like template pages (log-like lines with random numbers),
 * picked by a hash of its index and stamped with the index in its first and middle words: never zero-filled or same-filled, and LZ4
 * compresses it about 2.8x (lz4 -1 on single 4 KiB pages; the guest reports compr_data_size).
 * Prints "hog: ..." lines (fill and verify times, its own CPU time); exit 0 iff every word verified, 1 on corruption, 2 on bad usage.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096u

/* Log-like lines; each carries two pseudo-random numbers (the incompressible part). */
static const char *const LINES[] = {
    "swap: page %u moved to slot %u\n",
    "kernel: block device queue depth %u, tag %u\n",
    "{\"name\": \"object\", \"id\": %u, \"next\": %u},\n",
    "heap: value=%u key=%u list node\n",
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define TEMPLATES 256u
static unsigned char templates[TEMPLATES][PAGE];

/* Text-like template pages: LINES picked and numbered by a xorshift stream. */
static void make_templates(void)
{
	uint64_t s = 0x2545F4914F6CDD1Dull;
	char line[128];

	for (unsigned t = 0; t < TEMPLATES; t++) {
		size_t off = 0;
		while (off < PAGE) {
			s ^= s << 13;
			s ^= s >> 7;
			s ^= s << 17;
			int n = snprintf(line, sizeof(line), LINES[s & 3],
					 (unsigned)((s >> 8) & 0xffff), (unsigned)((s >> 24) & 0xff));
			size_t len = n < 0 ? 0 : (size_t)n;
			if (len > PAGE - off)
				len = PAGE - off;
			memcpy(templates[t] + off, line, len);
			off += len;
		}
	}
}

/* Page idx = a template picked by idx, stamped with idx in its first and middle words. */
static void fill_page(unsigned char *p, uint64_t idx)
{
	uint64_t h = idx * 0x9E3779B97F4A7C15ull;

	memcpy(p, templates[h >> 56], PAGE);
	memcpy(p, &idx, 8);
	memcpy(p + PAGE / 2, &idx, 8);
}

static int hog(int argc, char **argv);

/* -t SECS: the hog in a child, a locked parent to kill it. */
static int watched(unsigned secs, int argc, char **argv)
{
	if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0) {
		perror("hog: mlockall");
		return 2;
	}
	pid_t child = fork();
	if (child < 0) {
		perror("hog: fork");
		return 2;
	}
	if (child == 0) {
		/* Locked memory is not inherited: the child's pages swap as a hog's must. */
		munlockall();
		int rc = hog(argc, argv);
		fflush(NULL);
		_exit(rc);
	}
	double end = now() + secs;
	int status;
	for (;;) {
		pid_t r = waitpid(child, &status, WNOHANG);
		if (r == child)
			break;
		if (r < 0) {
			perror("hog: waitpid");
			return 2;
		}
		if (now() >= end) {
			kill(child, SIGKILL);
			waitpid(child, &status, 0);
			return 137;
		}
		usleep(100 * 1000);
	}
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

int main(int argc, char **argv)
{
	if (argc >= 3 && strcmp(argv[1], "-t") == 0) {
		int secs = atoi(argv[2]);
		if (secs <= 0) {
			fprintf(stderr, "hog: -t SECS must be > 0\n");
			return 2;
		}
		return watched((unsigned)secs, argc - 2, argv + 2);
	}
	return hog(argc, argv);
}

static int hog(int argc, char **argv)
{
	if (argc < 2 || argc > 4) {
		fprintf(stderr, "usage: hog MIB [PASSES [HOLD]]\n");
		return 2;
	}
	uint64_t mib = strtoull(argv[1], NULL, 10);
	int passes = argc >= 3 ? atoi(argv[2]) : 1;
	int hold = argc == 4 ? atoi(argv[3]) : 0;
	if (mib == 0 || passes < 1 || hold < 0) {
		fprintf(stderr, "hog: MIB and PASSES must be > 0, HOLD >= 0\n");
		return 2;
	}
	uint64_t pages = mib * 1024 * 1024 / PAGE;
	unsigned char *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
				  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (mem == MAP_FAILED) {
		perror("hog: mmap");
		return 2;
	}
	make_templates();
	double t0 = now();
	for (uint64_t i = 0; i < pages; i++)
		fill_page(mem + i * PAGE, i);
	double t1 = now();
	printf("hog: filled %llu MiB (%llu pages) in %.2fs\n", (unsigned long long)mib,
	       (unsigned long long)pages, t1 - t0);
	fflush(stdout);

	if (hold > 0) {
		printf("hog: holding %ds\n", hold);
		fflush(stdout);
		sleep((unsigned)hold);
	}

	unsigned char want[PAGE];
	uint64_t bad_words = 0, bad_pages = 0, words = 0;
	for (int pass = 1; pass <= passes; pass++) {
		double a = now();
		for (uint64_t i = 0; i < pages; i++) {
			const unsigned char *got = mem + i * PAGE;
			fill_page(want, i);
			words += PAGE / 8;
			if (memcmp(got, want, PAGE) == 0)
				continue;
			bad_pages++;
			for (unsigned w = 0; w < PAGE / 8; w++)
				if (memcmp(got + w * 8, want + w * 8, 8) != 0)
					bad_words++;
			if (bad_pages <= 5) {
				uint64_t first;
				memcpy(&first, got, 8);
				printf("hog: page %llu differs (first word %#llx)\n",
				       (unsigned long long)i, (unsigned long long)first);
			}
		}
		printf("hog: verify pass %d took %.2fs\n", pass, now() - a);
		fflush(stdout);
	}
	printf("hog: verified %llu words, %llu bad words in %llu bad pages\n",
	       (unsigned long long)words, (unsigned long long)bad_words,
	       (unsigned long long)bad_pages);
	/* the hog's own CPU time (faults, direct reclaim, zram's inline compression) */
	struct rusage ru;
	if (getrusage(RUSAGE_SELF, &ru) == 0)
		printf("hog: cpu %.2fs user %.2fs sys\n",
		       (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6,
		       (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6);
	return bad_words == 0 ? 0 : 1;
}
