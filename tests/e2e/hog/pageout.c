/*
 * pageout FILE...: pushes tmpfs files' pages out to swap as reclaim would (MADV_PAGEOUT on a
 * shared mapping of each, three passes 300 ms apart), then prints, per file, how many of its
 * pages are in swap (written there, if maybe still cached), and whether its last page is:
 *   FILE pages=N swapped=S last_swapped=0|1
 * Scenario b points it at a serving daemon's log file, whose last page must stay (the daemon
 * keeps it mapped and locked), and at a file of its own, which must go (or the push proved
 * nothing). The push passes over pages that another process maps too, so it tells a page the
 * daemon keeps from one it does not; that the daemon's is locked, as real reclaim needs, is
 * the unit test's part (pinned_log.rs).
 * Exit 0 once it printed every file.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

/*
 * Kilobytes of bytes [offset, offset + len) of the file open at fd that are in swap: the
 * "Swap:" line of /proc/self/smaps for a fresh, untouched mapping of them (for tmpfs, the
 * pages whose place in the file holds a swap entry). -1 on error.
 */
static long swapped_kb(int fd, off_t offset, size_t len)
{
	void *map = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, offset);
	if (map == MAP_FAILED) {
		perror("mmap");
		return -1;
	}
	char want[32], line[512];
	snprintf(want, sizeof(want), "%lx-", (unsigned long)map);
	FILE *smaps = fopen("/proc/self/smaps", "re");
	if (!smaps) {
		perror("/proc/self/smaps");
		return -1;
	}
	long kb = -1;
	int in = 0;
	while (fgets(line, sizeof(line), smaps)) {
		if (strchr(line, '-') && strncmp(line, want, strlen(want)) == 0)
			in = 1;
		else if (in && sscanf(line, "Swap: %ld kB", &kb) == 1)
			break;
	}
	fclose(smaps);
	munmap(map, len);
	if (kb < 0)
		fprintf(stderr, "no Swap: line for the mapping at %s\n", want);
	return kb;
}

struct file {
	const char *path;
	void *map;
	size_t pages;
};

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: pageout FILE...\n");
		return 2;
	}
	long page = sysconf(_SC_PAGESIZE);
	struct file *files = calloc(argc - 1, sizeof(*files));
	if (!files)
		return 1;
	for (int i = 1; i < argc; i++) {
		struct file *f = &files[i - 1];
		struct stat st;
		int fd = open(argv[i], O_RDWR | O_CLOEXEC);
		if (fd < 0 || fstat(fd, &st) != 0) {
			perror(argv[i]);
			return 1;
		}
		f->path = argv[i];
		f->pages = (st.st_size + page - 1) / page;
		if (f->pages == 0) {
			close(fd);
			continue;
		}
		f->map = mmap(NULL, f->pages * page, PROT_READ, MAP_SHARED, fd, 0);
		if (f->map == MAP_FAILED) {
			perror("mmap");
			return 1;
		}
		close(fd);
	}
	for (int pass = 0; pass < 3; pass++) {
		for (int i = 0; i < argc - 1; i++) {
			/*
			 * MADV_PAGEOUT reclaims only pages this process maps: fault them in (a
			 * page whose swap write is done comes back from the swap cache, and
			 * this pass frees it).
			 */
			for (size_t j = 0; j < files[i].pages; j++)
				(void)*(volatile const char *)((const char *)files[i].map + j * page);
			if (files[i].pages &&
			    madvise(files[i].map, files[i].pages * page, MADV_PAGEOUT) != 0) {
				perror("madvise(MADV_PAGEOUT)");
				return 1;
			}
		}
		usleep(300000);
	}
	for (int i = 0; i < argc - 1; i++) {
		struct file *f = &files[i];
		long all = 0, last = 0;
		if (f->pages) {
			int fd = open(f->path, O_RDONLY | O_CLOEXEC);
			if (fd < 0) {
				perror(f->path);
				return 1;
			}
			all = swapped_kb(fd, 0, f->pages * page);
			last = swapped_kb(fd, (f->pages - 1) * page, page);
			close(fd);
			if (all < 0 || last < 0)
				return 1;
		}
		printf("%s pages=%zu swapped=%ld last_swapped=%d\n", f->path, f->pages,
		       all / (page / 1024), last > 0);
	}
	return 0;
}
