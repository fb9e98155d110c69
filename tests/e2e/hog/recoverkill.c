/*
 * recoverkill DEV: kills (-9) a daemon in the middle of its recovery of a device: the first
 * `uzram daemon ... --recover N` process seen holding DEV (the device's /dev/ublkcN) open.
 * A recovering daemon opens it after START_USER_RECOVERY and before its queues serve
 * (libublk's UblkDev::new, in run_target), so the kill lands between the two. Prints one line
 * and exits 0 once it killed one; the caller runs the recovery that it interrupts.
 *
 * It looks every half millisecond (the window is tens of milliseconds under TCG), locked in
 * memory like crashkill, since it runs while a device is paused.
 */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* True when process PID runs `... daemon ... --recover ...`. */
static int recovering_daemon(const char *pid)
{
	char path[64], buf[4096];
	int daemon = 0, recover = 0;

	snprintf(path, sizeof(path), "/proc/%s/cmdline", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	for (char *p = buf; p < buf + n; p += strlen(p) + 1) {
		daemon |= strcmp(p, "daemon") == 0;
		recover |= strcmp(p, "--recover") == 0;
	}
	return daemon && recover;
}

/* True when process PID has DEV open. */
static int holds(const char *pid, const char *dev)
{
	char path[300], link[256];
	int found = 0;

	snprintf(path, sizeof(path), "/proc/%s/fd", pid);
	DIR *d = opendir(path);
	if (!d)
		return 0;
	struct dirent *e;
	while (!found && (e = readdir(d))) {
		if (e->d_name[0] == '.' || strlen(e->d_name) > 20)
			continue;
		snprintf(path, sizeof(path), "/proc/%s/fd/%s", pid, e->d_name);
		ssize_t n = readlink(path, link, sizeof(link) - 1);
		if (n > 0) {
			link[n] = 0;
			found = strcmp(link, dev) == 0;
		}
	}
	closedir(d);
	return found;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: recoverkill /dev/ublkcN\n");
		return 2;
	}
	if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0)
		perror("recoverkill: mlockall");
	for (;;) {
		DIR *proc = opendir("/proc");
		struct dirent *p;
		while (proc && (p = readdir(proc))) {
			if (p->d_name[0] < '1' || p->d_name[0] > '9' || strlen(p->d_name) > 20)
				continue;
			if (!recovering_daemon(p->d_name) || !holds(p->d_name, argv[1]))
				continue;
			int pid = atoi(p->d_name);
			if (kill(pid, SIGKILL) != 0) {
				perror("recoverkill: kill");
				return 2;
			}
			printf("recoverkill: killed recovering daemon %d (it holds %s open)\n", pid, argv[1]);
			fflush(stdout);
			return 0;
		}
		if (proc)
			closedir(proc);
		usleep(500);
	}
}
