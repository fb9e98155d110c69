/*
 * hangwatch SECS NAME [STALL]: diagnostics for a guest that stops making progress under memory
 * pressure. With STALL, it dumps as soon as swap has stood still for STALL seconds (the
 * kernel's Writeback and SwapFree in /proc/meminfo unchanged, read each second through a
 * descriptor opened at start: a re-read of a seq_file from its start allocates nothing),
 * or after SECS, whichever comes first: a stall that a swap device recovers from after a
 * minute is over by a fixed time.
 * Locks itself in memory (so it keeps running when everything else waits on swap-in), sleeps
 * SECS, then triggers sysrq 't' (every task's kernel stack, into the kernel log) through a
 * descriptor opened before the sleep: that write allocates nothing, where reading /proc does
 * (seq_file buffers), and in a guest whose free memory sat at the min watermark the /proc
 * reads waited in reclaim with everything else and no stack was ever printed. Then it prints
 * state, wait channel and kernel stack of every thread of every process whose comm starts with
 * NAME, with the CPU time each has used in user space and in the kernel, in all and in the
 * second before the dump (a thread that spins shows there), and the state of each io_uring the process has open. Last, the tail of each
 * log file the process has open: last because the file may sit in swap, on the very device
 * that is stuck. Killed by the scenario when the workload finishes in time. Its heap is
 * faulted in and locked up front: a new page later would wait in reclaim like everything else.
 */
#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void cat(const char *path, const char *prefix)
{
	char line[512];
	FILE *f = fopen(path, "r");

	if (!f)
		return;
	while (fgets(line, sizeof(line), f))
		printf("%s%s", prefix, line);
	fclose(f);
}

/* the last `keep` lines of a file, each after `prefix` */
static void tail(const char *path, const char *prefix, int keep)
{
	static char lines[64][256];
	int n = 0;
	FILE *f = fopen(path, "r");

	if (!f)
		return;
	if (keep > 64)
		keep = 64;
	while (fgets(lines[n % keep], sizeof(lines[0]), f))
		n++;
	fclose(f);
	for (int i = n > keep ? n - keep : 0; i < n; i++)
		printf("%s%s", prefix, lines[i % keep]);
}

static int read_line(const char *path, char *buf, size_t len)
{
	FILE *f = fopen(path, "r");

	if (!f || !fgets(buf, (int)len, f)) {
		if (f)
			fclose(f);
		return -1;
	}
	fclose(f);
	buf[strcspn(buf, "\n")] = 0;
	return 0;
}

/* user and kernel CPU time (fields 14 and 15) from a task's stat line, in ticks */
static int stat_cpu(const char *st, unsigned long *ut, unsigned long *kt)
{
	const char *rest = strrchr(st, ')');

	if (!rest || sscanf(rest + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", ut,
			    kt) != 2)
		return -1;
	return 0;
}

/* whether process `pid` is one of those watched: its comm (into `comm`) starts with `name` */
static int watched(const char *pid, const char *name, char *comm, size_t len)
{
	char path[300];

	snprintf(path, sizeof(path), "/proc/%s/comm", pid);
	return !read_line(path, comm, len) && !strncmp(comm, name, strlen(name));
}

/* CPU times of up to 512 threads, taken a second before the dump: a thread that spins
 * shows it as about a second of user or kernel time between the two */
static struct {
	long tid;
	unsigned long ut, kt;
} before[512];
static int nbefore;

static void sample_threads(const char *name)
{
	char path[600], comm[64], st[512];
	struct dirent *p, *t;
	DIR *proc = opendir("/proc");

	while (proc && (p = readdir(proc))) {
		if (!watched(p->d_name, name, comm, sizeof(comm)))
			continue;
		snprintf(path, sizeof(path), "/proc/%s/task", p->d_name);
		DIR *tasks = opendir(path);
		while (tasks && (t = readdir(tasks)) && nbefore < 512) {
			if (t->d_name[0] == '.')
				continue;
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stat", p->d_name, t->d_name);
			if (read_line(path, st, sizeof(st)) ||
			    stat_cpu(st, &before[nbefore].ut, &before[nbefore].kt))
				continue;
			before[nbefore].tid = atol(t->d_name);
			nbefore++;
		}
		if (tasks)
			closedir(tasks);
	}
	if (proc)
		closedir(proc);
}

/* "Writeback W SwapFree S" (kB) from /proc/meminfo, read from its start through `fd` */
static int swap_state(int fd, char *out, size_t len)
{
	static char text[8192];
	ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
	unsigned long wb = 0, sf = 0;

	if (n <= 0)
		return -1;
	text[n] = 0;
	char *w = strstr(text, "\nWriteback:"), *f = strstr(text, "\nSwapFree:");
	if (!w || !f || sscanf(w, "\nWriteback: %lu", &wb) != 1 ||
	    sscanf(f, "\nSwapFree: %lu", &sf) != 1)
		return -1;
	snprintf(out, len, "Writeback %lu SwapFree %lu", wb, sf);
	return 0;
}

int main(int argc, char **argv)
{
	char path[600], comm[64], buf[300];
	char logs[8][300];
	int nlogs = 0;
	struct dirent *p, *t;

	if (argc != 3 && argc != 4) {
		fprintf(stderr, "usage: hangwatch SECS NAME [STALL]\n");
		return 2;
	}
	mallopt(M_TRIM_THRESHOLD, 1 << 30);
	mallopt(M_MMAP_THRESHOLD, 1 << 30);
	if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0)
		perror("hangwatch: mlockall");
	char *pad = malloc(4 << 20);
	if (pad) {
		memset(pad, 1, 4 << 20);
		free(pad);
	}
	int sysrq = open("/proc/sysrq-trigger", O_WRONLY | O_CLOEXEC);
	if (sysrq < 0)
		perror("hangwatch: /proc/sysrq-trigger");
	unsigned secs = (unsigned)atoi(argv[1]);
	unsigned stall = argc == 4 ? (unsigned)atoi(argv[3]) : 0;
	int meminfo = stall ? open("/proc/meminfo", O_RDONLY | O_CLOEXEC) : -1;
	char last[64] = "", now[64];
	unsigned still = 0, waited = 0;
	while (waited + 1 < secs && (meminfo < 0 || still < stall)) {
		sleep(1);
		waited++;
		if (meminfo < 0 || swap_state(meminfo, now, sizeof(now)) != 0)
			continue;
		still = strcmp(now, last) == 0 ? still + 1 : 0;
		memcpy(last, now, sizeof(last));
	}
	if (meminfo >= 0 && still >= stall)
		printf("hangwatch: swap stood still for %us after %us (%s)\n", still, waited, last);
	fflush(stdout);
	/* t: every task's stack; l: what the CPUs run now (t skips running tasks); m: memory.
	 * First, before anything that reads /proc (see the top of the file). */
	for (const char *c = "tlm"; sysrq >= 0 && *c; c++)
		if (write(sysrq, c, 1) != 1)
			perror("hangwatch: sysrq");
	sample_threads(argv[2]);
	sleep(1);
	printf("hangwatch: no progress after %ss; threads of '%s':\n", argv[1], argv[2]);
	DIR *proc = opendir("/proc");
	while (proc && (p = readdir(proc))) {
		if (!watched(p->d_name, argv[2], comm, sizeof(comm)))
			continue;
		/* not cmdline: reading it takes the process's mmap lock, which is what a stuck
		 * process may hold (hangwatch then stopped at this line in CI) */
		printf("hangwatch: pid %s: %s\n", p->d_name, comm);
		/* open files: a read of a file whose pages are in swap blocks like a page fault */
		snprintf(path, sizeof(path), "/proc/%s/fd", p->d_name);
		DIR *fds = opendir(path);
		while (fds && (t = readdir(fds))) {
			char target[300];
			if (t->d_name[0] == '.')
				continue;
			snprintf(path, sizeof(path), "/proc/%s/fd/%s", p->d_name, t->d_name);
			ssize_t n = readlink(path, target, sizeof(target) - 1);
			target[n < 0 ? 0 : n] = 0;
			printf("hangwatch:   fd %s -> %s\n", t->d_name, target);
			size_t tl = strlen(target);
			if (!strcmp(target, "anon_inode:[io_uring]")) {
				snprintf(path, sizeof(path), "/proc/%s/fdinfo/%s", p->d_name, t->d_name);
				snprintf(buf, sizeof(buf), "hangwatch:     fd %s: ", t->d_name);
				tail(path, buf, 24);
			} else if (tl > 4 && !strcmp(target + tl - 4, ".log") && nlogs < 8) {
				int dup = 0;
				for (int i = 0; i < nlogs; i++)
					dup |= !strcmp(logs[i], target);
				if (!dup)
					snprintf(logs[nlogs++], sizeof(logs[0]), "%s", target);
			}
		}
		if (fds)
			closedir(fds);
		snprintf(path, sizeof(path), "/proc/%s/task", p->d_name);
		DIR *tasks = opendir(path);
		while (tasks && (t = readdir(tasks))) {
			if (t->d_name[0] == '.')
				continue;
			char tc[64] = "?", wchan[128] = "?", st[512] = "?";
			snprintf(path, sizeof(path), "/proc/%s/task/%s/comm", p->d_name, t->d_name);
			read_line(path, tc, sizeof(tc));
			snprintf(path, sizeof(path), "/proc/%s/task/%s/wchan", p->d_name, t->d_name);
			read_line(path, wchan, sizeof(wchan));
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stat", p->d_name, t->d_name);
			read_line(path, st, sizeof(st));
			char *state = strrchr(st, ')');
			unsigned long ut = 0, kt = 0;
			stat_cpu(st, &ut, &kt);
			long hz = sysconf(_SC_CLK_TCK);
			if (hz <= 0)
				hz = 100;
			char last[80] = "";
			for (int i = 0; i < nbefore; i++)
				if (before[i].tid == atol(t->d_name))
					snprintf(last, sizeof(last), " (last second: user %.2fs kernel %.2fs)",
						 (double)(ut - before[i].ut) / hz,
						 (double)(kt - before[i].kt) / hz);
			printf("hangwatch: pid %s tid %s (%s) state %.1s wchan %s cpu user %.2fs kernel %.2fs%s\n",
			       p->d_name, t->d_name, tc, state ? state + 2 : "?", wchan,
			       (double)ut / hz, (double)kt / hz, last);
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stack", p->d_name, t->d_name);
			snprintf(buf, sizeof(buf), "hangwatch:   ");
			cat(path, buf);
		}
		if (tasks)
			closedir(tasks);
	}
	if (proc)
		closedir(proc);
	cat("/proc/meminfo", "hangwatch: meminfo ");
	fflush(stdout);
	for (int i = 0; i < nlogs; i++) {
		printf("hangwatch: the last lines of %s:\n", logs[i]);
		fflush(stdout);
		tail(logs[i], "hangwatch:   log ", 40);
		fflush(stdout);
	}
	return 0;
}
