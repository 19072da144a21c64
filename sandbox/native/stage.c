/* sandboxrun's native stage: the child's setup steps and PID 1, without a Python child.

   The supervisor (Python) compiles a RunPlan into a program of ordered steps
   (sandbox/native/ops.py) and posix_spawns this binary with the program on fd 3 (a rootless
   caller's fork server does, from inside its user namespace).
   Forking a Python process costs a page-table copy of its heap plus hundreds of
   copy-on-write faults; this stage is a few pages, so each run pays neither.

   argv[0] is the mode: "sandboxrun-init" (PID 1 of a new pid namespace: the caller's
   thread unshared CLONE_NEWPID before it spawned us, so we are born PID 1 and the caller
   is our parent, reaping us and holding our pidfd), "sandboxrun-stage" (no pid namespace:
   this process is the sandbox), "sandboxrun-template" (build a view's static part and
   hold it, op 'H'). The first steps write us into the run's v1 cgroups (op 'J'), before
   any process of the sandbox exists.

   fd 3  the program (a memfd), read whole, then closed
   fd 4  the report pipe: "E step errno msg", "A key=value", "T step=ms ...", "S pid", "X status utime stime maxrss own_cpu"
   fd 5  "sandboxrun-init" only, and only where the caller did not make the pid namespace itself:
         we make it (clone_pid_namespace) and send PID 1's pid (or -errno) down this pipe
   fd 17 with fd 5, on cgroup v2: the run's cgroup directory, which PID 1 is cloned into
   fds 6.. named by the program's steps (cgroup sync pipe, template namespace, v1 tasks files, ready netns)

   Every op is one record: code (1 byte), argument count (1 byte), then each argument as a
   4-byte little-endian length, its bytes and a NUL. Numbers travel as decimal text. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define PROGRAM_FD 3
#define REPORT_FD 4
#define PIDNS_FD 5
#define INTO_CGROUP_FD 17  /* with PIDNS_FD: the run's cgroup v2 directory, to clone PID 1 into */
#define MAX_ARGS 8
#define MAX_SLOTS 64
#define NOGROUP 65534

#ifndef SYS_pivot_root
#define SYS_pivot_root 155
#endif
#define SYS_OPEN_TREE 428
#define SYS_MOVE_MOUNT 429
#define SYS_CLOSE_RANGE 436
#define SYS_LANDLOCK_CREATE_RULESET 444
#define SYS_LANDLOCK_ADD_RULE 445
#define SYS_LANDLOCK_RESTRICT_SELF 446
#define SYS_MOUNT_SETATTR 442
#define OPEN_TREE_CLONE 1
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 4
#endif
#define MOUNT_ATTR_IDMAP 0x00100000

struct arg { const char *s; uint32_t n; };
struct op { char code; int nargs; struct arg a[MAX_ARGS]; };

static char step[64] = "stage", sub[64] = "";
static int tracing;
static char trace_buf[2048];
static size_t trace_len;
static struct timespec step_start;
static int slots[MAX_SLOTS];
static int run_uid = -1, run_gid = -1;
static int as_owner;  /* the workdir could not be idmapped: the run has its owner's uid ('I') */
static int landlock_rs = -1;
static long landlock_abi;  /* of this kernel, once the profile asked for Landlock ('a') */

static void report(const char *fmt, ...) {
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
    for (int i = 0; i < n; i++)
        if (buf[i] == '\n') buf[i] = ' ';
    buf[n++] = '\n';
    (void)!write(REPORT_FD, buf, n);
}

static void fail(int err, const char *fmt, ...) __attribute__((noreturn));
static void fail(int err, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char line[2300];
    int n = sub[0] ? snprintf(line, sizeof line, "E %s:%s %d %s", step, sub, err, msg)
                   : snprintf(line, sizeof line, "E %s %d %s", step, err, msg);
    if (n > (int)sizeof line - 2) n = sizeof line - 2;
    for (int i = 0; i < n; i++)
        if (line[i] == '\n') line[i] = ' ';
    line[n++] = '\n';
    (void)!write(REPORT_FD, line, n);
    _exit(125);
}

/* A failed syscall: "<what>: <strerror>" (the Python steps say the same). */
#define CHECK(expr, ...) do { if ((expr) < 0) { int e_ = errno; char w_[PATH_MAX + 64]; \
    snprintf(w_, sizeof w_, __VA_ARGS__); fail(e_, "[Errno %d] %s: %s", e_, strerror(e_), w_); } } while (0)

static double ms_since(struct timespec *t) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - t->tv_sec) * 1e3 + (now.tv_nsec - t->tv_nsec) / 1e6;
}

static void mark(const char *name, uint32_t n) {
    if (tracing && step[0] && strcmp(step, "stage") != 0 && trace_len < sizeof trace_buf - 80)
        trace_len += snprintf(trace_buf + trace_len, sizeof trace_buf - trace_len, " %s=%.4f", step,
                              ms_since(&step_start));
    clock_gettime(CLOCK_MONOTONIC, &step_start);
    if (n >= sizeof step) n = sizeof step - 1;
    memcpy(step, name, n);
    step[n] = 0;
    sub[0] = 0;
}

/* ------------------------------------------------------------------ program decoding */

static char *program;
static size_t program_len, program_pos;

static void read_program(void) {
    struct stat st;
    if (fstat(PROGRAM_FD, &st) < 0 || st.st_size <= 0) fail(errno, "cannot read the stage program");
    program = malloc(st.st_size + 1);
    if (!program) fail(ENOMEM, "stage program too large");
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = pread(PROGRAM_FD, program + got, st.st_size - got, got);
        if (r <= 0) fail(r < 0 ? errno : EIO, "short read of the stage program");
        got += r;
    }
    program_len = got;
    close(PROGRAM_FD);
}

static int next_op(struct op *op) {
    if (program_pos >= program_len) return 0;
    if (program_len - program_pos < 2) fail(EINVAL, "truncated stage program");
    op->code = program[program_pos];
    op->nargs = (unsigned char)program[program_pos + 1];
    program_pos += 2;
    if (op->nargs > MAX_ARGS) fail(EINVAL, "bad stage program");
    for (int i = 0; i < op->nargs; i++) {
        uint32_t n;
        if (program_len - program_pos < 4) fail(EINVAL, "truncated stage program");
        memcpy(&n, program + program_pos, 4);
        program_pos += 4;
        /* (n + 1 would wrap for n = 2^32 - 1) */
        if (n >= program_len - program_pos || program[program_pos + n] != 0) fail(EINVAL, "truncated stage program");
        op->a[i].s = program + program_pos;  /* each argument is followed by a NUL */
        op->a[i].n = n;
        program_pos += n + 1;
    }
    return 1;
}

static long num(struct op *op, int i) { return strtol(op->a[i].s, NULL, 10); }
static const char *str_or_null(struct op *op, int i) { return op->a[i].n ? op->a[i].s : NULL; }

static int slot(struct op *op, int i) {
    long k = num(op, i);
    if (k < 0 || k >= MAX_SLOTS) fail(EINVAL, "bad slot");
    return (int)k;
}

/* --------------------------------------------------------------------- filesystem */

static const struct { unsigned long st, ms; } locked_flags[] = {
    {ST_NOSUID, MS_NOSUID}, {ST_NODEV, MS_NODEV}, {ST_NOEXEC, MS_NOEXEC}, {ST_RDONLY, MS_RDONLY},
    {ST_NOATIME, MS_NOATIME}, {ST_NODIRATIME, MS_NODIRATIME}, {ST_RELATIME, MS_RELATIME},
};

/* Flags the kernel locks on a bind inside a user namespace must be kept on the remount. */
static unsigned long kept_flags(unsigned long f_flag, int writable, int device) {
    unsigned long flags = 0;
    for (size_t i = 0; i < sizeof locked_flags / sizeof *locked_flags; i++) {
        if (!(f_flag & locked_flags[i].st)) continue;
        if (writable && locked_flags[i].ms == MS_RDONLY) continue;
        if (device && locked_flags[i].ms == MS_NODEV) continue;
        flags |= locked_flags[i].ms;
    }
    return flags;
}

static int makedirs(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n >= sizeof buf) { errno = ENAMETOOLONG; return -1; }
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, mode) < 0 && errno != EEXIST) return -1;
    return 0;
}

/* While a view is built under its new root (op 'Q'), before pivot_root, a link in that
   root resolves on the host: one inside a bound directory (planted by a run) would make a
   mount point, or mount, on the host. Every path made or mounted on below the root is
   refused if one of its components there is a link. */
static char view_root[PATH_MAX] = "";

static void no_link_below_root(const char *path) {
    size_t r = strlen(view_root);
    if (!r || strncmp(path, view_root, r) != 0 || path[r] != '/') return;
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + r + 1;; p++) {
        if (*p != '/' && *p != 0) continue;
        char c = *p;
        *p = 0;
        struct stat st;
        if (lstat(buf, &st) == 0 && S_ISLNK(st.st_mode)) {
            errno = ELOOP;
            CHECK(-1, "'%s' is a link in the way (until pivot_root it would resolve on the host)", buf);
        }
        if (c == 0) break;
        *p = c;
    }
}

static void mkpoint(const char *path, int is_dir) {
    struct stat st;
    no_link_below_root(path);
    if (lstat(path, &st) == 0) return;
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", path);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = 0;
        CHECK(makedirs(parent, 0755), "'%s'", parent);
    }
    if (is_dir) {
        CHECK(mkdir(path, 0755), "'%s'", path);
    } else {
        int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
        CHECK(fd, "'%s'", path);
        close(fd);
    }
}

static void bind_fd(int fd, const char *target, int writable, int device) {
    char src[64];
    snprintf(src, sizeof src, "/proc/self/fd/%d", fd);
    CHECK(mount(src, target, NULL, MS_BIND, NULL), "mount %s", target);
    struct statvfs sv;
    CHECK(fstatvfs(fd, &sv), "statvfs %s", target);
    unsigned long flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (device ? 0 : MS_NODEV) | (writable ? 0 : MS_RDONLY);
    flags |= kept_flags(sv.f_flag, writable, device);
    CHECK(mount(NULL, target, NULL, flags, NULL), "mount %s", target);
}

/* Move a detached tree (open_tree, its fd at *tree, closed here) to target, then remount it
   nosuid, nodev unless a device, read-only unless writable, keeping the flags the kernel locks. */
static void move_tree(int *tree, const char *target, int writable, int device) {
    no_link_below_root(target);
    CHECK(syscall(SYS_MOVE_MOUNT, *tree, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH), "move_mount %s", target);
    close(*tree);
    *tree = -1;
    struct statvfs sv;
    CHECK(statvfs(target, &sv), "statvfs %s", target);
    unsigned long flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (device ? 0 : MS_NODEV) | (writable ? 0 : MS_RDONLY);
    CHECK(mount(NULL, target, NULL, flags | kept_flags(sv.f_flag, writable, device), NULL), "mount %s", target);
}

/* A terminal run's terminal (fd 0) as a detached mount, found by its path in this mount
   namespace (a mount of another namespace cannot be cloned) and checked to be that very
   terminal; -1 where it cannot be: the run then has no /dev/console (ttyname() fails). */
static int clone_terminal(void) {
    char path[PATH_MAX];
    ssize_t n = readlink("/proc/self/fd/0", path, sizeof path - 1);
    if (n <= 0 || path[0] != '/') return -1;
    path[n] = 0;
    int tree = (int)syscall(SYS_OPEN_TREE, AT_FDCWD, path, OPEN_TREE_CLONE | O_CLOEXEC);
    struct stat got, want;
    if (tree >= 0 && (fstat(tree, &got) < 0 || fstat(0, &want) < 0 || got.st_dev != want.st_dev
                      || got.st_ino != want.st_ino || got.st_rdev != want.st_rdev)) {
        close(tree);
        tree = -1;
    }
    return tree;
}

static void write_file(const char *path, const char *data, size_t n, mode_t mode) {
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
    CHECK(fd, "'%s'", path);
    while (n) {
        ssize_t w = write(fd, data, n);
        CHECK(w, "'%s'", path);
        data += w;
        n -= w;
    }
    close(fd);
}

static int exists(const char *p) { struct stat st; return stat(p, &st) == 0; }
static int is_dir(const char *p) { struct stat st; return stat(p, &st) == 0 && S_ISDIR(st.st_mode); }

/* A user namespace that maps the disk's owner onto the run's ids, for an idmapped workdir.
   It lives as long as a process is in it: a child makes it, we map it, keep an fd, end the child. */
static int idmap_userns(long disk_uid, long run_uid_, long disk_gid, long run_gid_) {
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) < 0) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        /* Our pid as the mounted /proc knows it: we are in a newer pid namespace than it. */
        char self[32] = "0";
        close(pipefd[0]);
        if (unshare(CLONE_NEWUSER) == 0) {
            ssize_t n = readlink("/proc/self", self, sizeof self - 1);
            self[n > 0 ? n : 0] = 0;
        }
        (void)!write(pipefd[1], self, strlen(self) + 1);
        pause();
        _exit(0);
    }
    close(pipefd[1]);
    char seen[32] = "";
    int fd = -1;
    ssize_t got = read(pipefd[0], seen, sizeof seen - 1);
    seen[got > 0 ? got : 0] = 0;
    if (got > 0 && atoi(seen) > 0) {
        char path[64], map[64];
        int good = 1;
        const char *files[2] = {"uid_map", "gid_map"};
        long ids[2][2] = {{disk_uid, run_uid_}, {disk_gid, run_gid_}};
        for (int i = 0; i < 2 && good; i++) {
            snprintf(path, sizeof path, "/proc/%s/%s", seen, files[i]);
            int m = snprintf(map, sizeof map, "%ld %ld 1\n", ids[i][0], ids[i][1]);
            int f = open(path, O_WRONLY | O_CLOEXEC);
            good = f >= 0 && write(f, map, m) == m;
            if (f >= 0) close(f);
        }
        if (good) {
            snprintf(path, sizeof path, "/proc/%s/ns/user", seen);
            fd = open(path, O_RDONLY | O_CLOEXEC);
        }
    }
    close(pipefd[0]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return fd;
}

struct mount_attr_s { uint64_t attr_set, attr_clr, propagation, userns_fd; };

static void proc_readonly(const char *p) {
    if (!exists(p)) return;
    CHECK(mount(p, p, NULL, MS_BIND | MS_REC, NULL), "mount %s", p);
    CHECK(mount(NULL, p, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL), "mount %s", p);
}

static void proc_mask(const char *p, const char *null) {
    struct stat st;
    if (stat(p, &st) < 0) return;  /* not on this kernel: one lookup, not two */
    if (S_ISDIR(st.st_mode)) {
        CHECK(mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0"), "mount %s", p);
    } else if (exists(null)) {
        CHECK(mount(null, p, NULL, MS_BIND, NULL), "mount %s", p);
    }
}

/* ------------------------------------------------------------------ other layers */

static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    CHECK(s, "socket");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    CHECK(ioctl(s, SIOCGIFFLAGS, &ifr), "SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP;
    CHECK(ioctl(s, SIOCSIFFLAGS, &ifr), "SIOCSIFFLAGS lo");
    close(s);
}

static void await_cgroup(int fd) {
    char buf[1024];
    size_t n = 0;
    while (n < sizeof buf - 1) {
        ssize_t r = read(fd, buf + n, sizeof buf - 1 - n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        n += r;
        if (buf[n - 1] == '\n') break;
    }
    buf[n] = 0;
    close(fd);
    if (n && buf[0] == '1') return;
    if (n && buf[n - 1] == '\n') buf[n - 1] = 0;
    int err = n > 1 ? atoi(buf + 1) : 0;
    const char *why = n > 1 ? strchr(buf, ' ') : NULL;
    fail(err, "%s", why ? why + 1 : "the supervisor went away");
}

/* Landlock: same rights as sandbox/isolation/landlock.py. */
#define LL_ABI1 ((1ULL << 13) - 1)
#define LL_REFER (1ULL << 13)
#define LL_TRUNCATE (1ULL << 14)
#define LL_IOCTL_DEV (1ULL << 15)
#define LL_READ_ONLY ((1ULL << 0) | (1ULL << 2) | (1ULL << 3))
#define LL_FILE ((1ULL << 0) | (1ULL << 1) | (1ULL << 2) | LL_TRUNCATE | LL_IOCTL_DEV)

static uint64_t ll_handled(long abi) {
    uint64_t r = LL_ABI1;
    if (abi >= 2) r |= LL_REFER;
    if (abi >= 3) r |= LL_TRUNCATE;
    if (abi >= 5) r |= LL_IOCTL_DEV;
    return r;
}

struct __attribute__((packed)) path_beneath { uint64_t allowed; int32_t parent_fd; };

static void ll_rules(int rs, const struct arg *paths, uint64_t access, uint64_t handled) {
    for (const char *p = paths->s; p < paths->s + paths->n; p += strlen(p) + 1) {
        if (!*p) continue;
        int fd = open(p, O_PATH | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT || errno == ENOTDIR) continue;
            CHECK(-1, "landlock rule '%s'", p);
        }
        struct stat st;
        uint64_t a = access & handled;
        if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode)) a &= LL_FILE;
        if (a) {
            struct path_beneath pb = {a, fd};
            if (syscall(SYS_LANDLOCK_ADD_RULE, rs, 1, &pb, 0) < 0) {
                int e = errno;
                fail(e, "[Errno %d] landlock_add_rule: %s: '%s'", e, strerror(e), p);
            }
        }
        close(fd);
    }
}

static void landlock_prepare(struct op *op) {
    int required = strcmp(op->a[0].s, "required") == 0;
    long abi = syscall(SYS_LANDLOCK_CREATE_RULESET, NULL, 0, 1);
    if (abi < 0) {
        if (errno != ENOSYS && errno != EOPNOTSUPP && errno != EPERM)
            CHECK(-1, "landlock_create_ruleset(VERSION)");
        abi = 0;
    }
    if (abi == 0) {
        if (required) fail(95, "landlock is not available on this kernel");
        report("A landlock=0");
        return;
    }
    landlock_abi = abi;
    uint64_t handled = ll_handled(abi);
    landlock_rs = syscall(SYS_LANDLOCK_CREATE_RULESET, &handled, sizeof handled, 0);
    CHECK(landlock_rs, "landlock_create_ruleset");
    ll_rules(landlock_rs, &op->a[1], LL_READ_ONLY, handled);
    ll_rules(landlock_rs, &op->a[2], handled, handled);
    report("A landlock=%ld", abi);
}

/* A file of /proc/self, written whole (a short write there is a refusal). */
static void write_proc(const char *path, const char *text) {
    size_t n = strlen(text);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    CHECK(fd, "'%s'", path);
    ssize_t w = write(fd, text, n);
    if (w >= 0 && (size_t)w != n) errno = EIO;
    CHECK(w == (ssize_t)n ? 0 : -1, "'%s'", path);
    close(fd);
}

/* Rootless: one more user namespace, mapping the run's uid/gid onto ours (the fork server's
   root, itself the caller on the host), so the command is not uid 0 even inside. */
static void enter_user_namespace(long inside_uid, long inside_gid) {
    char map[64];
    long uid = geteuid(), gid = getegid();
    CHECK(unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)");
    write_proc("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "%ld %ld 1\n", inside_uid, uid);
    write_proc("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "%ld %ld 1\n", inside_gid, gid);
    write_proc("/proc/self/gid_map", map);
}

static void drop_bounding_set(int best_effort) {
    for (int cap = 0; cap < 64; cap++) {
        if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) < 0) break;  /* past the kernel's last cap */
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && !best_effort) CHECK(-1, "PR_CAPBSET_DROP %d", cap);
    }
}

static void clear_capabilities(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    CHECK(syscall(SYS_capset, &hdr, data), "capset");
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

static void load_seccomp(struct op *op) {
    struct sock_fprog prog = {(unsigned short)(op->a[0].n / 8), (struct sock_filter *)op->a[0].s};
    if (op->a[0].n == 0 || op->a[0].n % 8) fail(EINVAL, "not a BPF program");
    /* The argument bytes are not 8-aligned in the program: copy them. */
    void *buf = malloc(op->a[0].n);
    if (!buf) fail(ENOMEM, "seccomp");
    memcpy(buf, op->a[0].s, op->a[0].n);
    prog.filter = buf;
    CHECK(syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog), "seccomp");
    free(buf);
}

/* ------------------------------------------------------------------------ exec, init */

static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

/* No pid namespace: our parent-death signal (ops.py PARENT_GONE), taken (not SIGKILL) so that
   the run's processes are killed before we go; with SIGKILL they would be orphaned out of reach. */
#define PARENT_GONE 64
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET 1
#define LL_SCOPE_SIGNAL 2
#define LL_FS_REFER (1ULL << 13)  /* rename and link across directories */

static volatile int exec_scope_failed;

/* Born PID 1 of the run's own pid namespace ("sandboxrun-init"), from our mode, not from
   getpid(): a caller that entered a pid namespace without forking (unshare --pid) makes its
   first child PID 1 of that one, which is no namespace of the run's. */
static int own_pid_ns;

/* Without a pid namespace (the nested profile) the run's processes are found as the
   descendants of this process, which is their child subreaper: an orphan of the run, a
   double-forked daemon's included, is reparented to us, never to the host's init. Each
   is signalled through a fd of its /proc directory whose parent is checked through that
   fd after it was opened, so a pid that an exited process left to an unrelated one is
   never signalled. Returns how many were signalled. */
/* This process's pid as /proc numbers it: not getpid() where /proc belongs to another pid
   namespace than ours (a caller that entered one without mounting its own /proc). */
static pid_t proc_self(void) {
    char buf[32];
    ssize_t len = readlink("/proc/self", buf, sizeof buf - 1);
    if (len <= 0) return getpid();
    buf[len] = 0;
    return (pid_t)atoi(buf);
}

static int signal_tree(int sig) {
    size_t cap = 1024, n = 0;
    pid_t *pid = malloc(cap * sizeof *pid), *ppid = malloc(cap * sizeof *ppid);
    DIR *d = opendir("/proc");
    if (!pid || !ppid || !d) {
        free(pid); free(ppid);
        if (d) closedir(d);
        return 0;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t len = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (len <= 0) continue;
        buf[len] = 0;
        char *rp = strrchr(buf, ')');  /* the name may hold spaces and parentheses */
        char state;
        int parent;
        /* zombies too: a leader whose own thread exited reads Z while its other threads run */
        if (!rp || sscanf(rp + 1, " %c %d", &state, &parent) != 2) continue;
        if (n == cap) {
            cap *= 2;
            pid_t *a = realloc(pid, cap * sizeof *pid), *b = realloc(ppid, cap * sizeof *ppid);
            if (!a || !b) { free(a ? a : pid); free(b ? b : ppid); closedir(d); return 0; }
            pid = a; ppid = b;
        }
        pid[n] = atoi(e->d_name);
        ppid[n++] = parent;
    }
    closedir(d);
    /* from us outwards, one pass a generation: a process is ours when its parent is (a
       bitmap by pid: PID_MAX_LIMIT is 2^22, so 512 KiB) */
    unsigned char *mine = calloc(1 << 19, 1), *ours = calloc(n ? n : 1, 1);
    int sent = 0, grew = 1;
    pid_t me = proc_self();
#define MINE(p) ((p) > 0 && (p) < (1 << 22) && (mine[(p) >> 3] >> ((p) & 7) & 1))
    while (mine && ours && grew) {
        grew = 0;
        for (size_t i = 0; i < n; i++)
            if (!ours[i] && pid[i] < (1 << 22) && (ppid[i] == me || MINE(ppid[i]))) {
                ours[i] = 1;
                mine[pid[i] >> 3] |= (unsigned char)(1 << (pid[i] & 7));
                grew = 1;
            }
    }
    for (size_t i = 0; mine && ours && i < n; i++) {
        if (!ours[i]) continue;
        /* A /proc/<pid> directory fd holds this very process, like a pidfd, and
           pidfd_send_signal takes it; unlike pidfd_open it needs no pid of our own pid
           namespace, only /proc's numbering (see proc_self). */
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%d", pid[i]);
        int pfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (pfd < 0) continue;
        int fd = openat(pfd, "stat", O_RDONLY | O_CLOEXEC), parent = -1;
        ssize_t len = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0) close(fd);
        if (len > 0) {
            buf[len] = 0;
            char *rp = strrchr(buf, ')'), state;
            if (!rp || sscanf(rp + 1, " %c %d", &state, &parent) != 2) parent = -1;
        }
        int still = parent == me || MINE(parent);  /* read through the fd: this process, still ours? */
        if (still && syscall(SYS_pidfd_send_signal, pfd, sig, NULL, 0) == 0) sent++;
        close(pfd);
    }
#undef MINE
    free(mine); free(ours); free(pid); free(ppid);
    return sent;
}

/* The command has exited and there is no pid namespace to end the rest: kill our
   descendants until none is left, reaping them (their CPU time then counts in ours). No
   child left means no descendant either (orphans come to us): then nothing is scanned. */
static void kill_tree(void) {
    for (int round = 0; round < 200; round++) {  /* ~2 s: a process we may not signal cannot hold us */
        pid_t r;
        while ((r = waitpid(-1, NULL, WNOHANG | __WALL)) > 0) {}
        if (r < 0 && errno == ECHILD) return;
        signal_tree(SIGKILL);
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* PID 1, once the command has exited: kill and reap what is left of the run. The kernel
   would kill it too when we exit, but it reaps those processes without adding their CPU
   time to ours; reaped here, RUSAGE_CHILDREN (and the supervisor's wait4 on us) hold the
   whole run's. A process we may not signal (none should exist: every process has our uid
   and no capabilities), or one stuck in the kernel, would block waitpid: the wait is
   bounded (2 s), by sigtimedwait on SIGCHLD, which is held (no handler, no alarm: a
   SIGALRM the command sent us earlier cannot cut it short, nor one lost between a check
   and a blocking wait hold it for ever). */
static void reap_the_rest(void) {
    kill(-1, SIGKILL);
    struct timespec end, now;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += 2;
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    for (;;) {
        pid_t r;
        while ((r = waitpid(-1, NULL, WNOHANG | __WALL)) > 0) {}
        if (r < 0 && errno != EINTR) return;  /* ECHILD: none left */
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long left = (long long)(end.tv_sec - now.tv_sec) * 1000000000LL + (end.tv_nsec - now.tv_nsec);
        if (left <= 0) return;
        struct timespec wait = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
        sigtimedwait(&chld, NULL, &wait);  /* a child's exit, or the time left */
    }
}

/* The CPU time of process `pid` alone, user + system (what RLIMIT_CPU counts; its wait4
   rusage adds its reaped children's), from its CPU clock, which a zombie still has: -1 if
   unreadable. The Python child (child.py, own_cpu_time) reads the same clock. */
static double own_cpu_time(pid_t pid) {
    clockid_t clock;
    struct timespec ts;
    if (clock_getcpuclockid(pid, &clock) != 0 || clock_gettime(clock, &ts) != 0) return -1;
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The parent-death signal covers a supervisor that dies from here on, not one that died
   between our spawn and this step: the signal would never come, and the run would go on
   with no one to end it at its timeout. Its report pipe tells: the supervisor holds the
   reading end for the whole run, and a pipe whose readers are all gone polls POLLERR. */
/* Every fd above 2 but the report pipe, which exec closes (CVE-2024-21626): close_range, or
   where there is none (before 5.9, or a container's seccomp profile refuses it) every fd
   /proc lists, however high (a caller's fd above 1023 reached the command before). */
static void close_inherited_fds(void) {
    fcntl(REPORT_FD, F_SETFD, FD_CLOEXEC);
    if (syscall(SYS_CLOSE_RANGE, 3, REPORT_FD - 1, 0) == 0 && syscall(SYS_CLOSE_RANGE, REPORT_FD + 1, ~0U, 0) == 0)
        return;
    for (int pass = 0; pass < 1024; pass++) {
        DIR *d = opendir("/proc/self/fd");
        if (!d) CHECK(-1, "close the inherited fds (no close_range, and no /proc/self/fd)");
        int fds[256], n = 0, more = 0, own = dirfd(d);
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
            int fd = atoi(e->d_name);
            if (fd <= 2 || fd == REPORT_FD || fd == own) continue;
            if (n < 256) fds[n++] = fd; else more = 1;
        }
        closedir(d);
        for (int i = 0; i < n; i++) close(fds[i]);
        if (!more) return;
    }
    errno = EMFILE;
    CHECK(-1, "close the inherited fds");
}

static void supervised_or_exit(void) {
    struct pollfd p = {.fd = REPORT_FD, .events = POLLOUT};
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLERR | POLLNVAL))) _exit(125);
}

static void reset_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    uint64_t raw[4] = {0, 0, 0, 0};  /* struct kernel_sigaction, all zero: SIG_DFL, no flags, empty mask */
    for (int s = 1; s < NSIG; s++)
        if (s != SIGKILL && s != SIGSTOP && sigaction(s, &sa, NULL) < 0)
            /* glibc refuses its own signals (32, 33), which its posix_spawn left ignored for us:
               ignored signals survive exec, and the command must start with none */
            syscall(SYS_rt_sigaction, s, raw, NULL, 8);
}

static char **split(const struct arg *a, int *count) {
    int n = 0;
    for (uint32_t i = 0; i < a->n; i++) n += a->s[i] == 0;
    n += a->n > 0;
    char **v = calloc(n + 1, sizeof *v);
    if (!v) fail(ENOMEM, "exec");
    int k = 0;
    if (a->n)
        for (const char *p = a->s; p <= a->s + a->n && k < n; p += strlen(p) + 1) v[k++] = (char *)p;
    v[k] = NULL;
    if (count) *count = k;
    return v;
}

__attribute__((noinline)) static const char *find_executable(const char *name, const char *path, char *buf, size_t size) {
    if (strchr(name, '/')) return name;
    const char *denied = NULL;
    static char denied_buf[PATH_MAX];
    for (const char *d = path;; ) {
        const char *end = strchr(d, ':');
        size_t len = end ? (size_t)(end - d) : strlen(d);
        snprintf(buf, size, "%.*s/%s", (int)(len ? len : 1), len ? d : ".", name);
        struct stat st;
        if (stat(buf, &st) == 0 && S_ISREG(st.st_mode)) {
            if (access(buf, X_OK) == 0) return buf;
            if (!denied) { snprintf(denied_buf, sizeof denied_buf, "%s", buf); denied = denied_buf; }
        }
        if (!end) break;
        d = end + 1;
    }
    if (denied) return denied;  /* exec then says EACCES -> 126 */
    fail(2, "%s: command not found", name);
}

static volatile int exec_errno;


#define ENOEXEC_WHY "exec format error (no #! line, and not a program for this machine)"

/* Why execve said ENOENT of a file that is there: the interpreter its #! line names, or an
   ELF program's loader, is missing. `out` holds the words. */
static const char *missing_interpreter(const char *path, char *out, size_t n) {
    char head[256] = {0};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t got = fd >= 0 ? read(fd, head, sizeof head - 1) : -1;
    if (fd >= 0) close(fd);
    if (got > 2 && head[0] == '#' && head[1] == '!') {
        const char *s = head + 2;
        s += strspn(s, " \t");
        size_t len = strcspn(s, " \t\n");  /* as the kernel reads it: a CR stays in the name */
        int cr = len > 0 && s[len - 1] == '\r';
        snprintf(out, n, "bad interpreter: %.*s%s: not found (its #! line%s)", (int)(len - cr), s, cr ? "^M" : "",
                 cr ? ", which ends in a CR: CRLF line endings?" : "");
    } else if (got >= 4 && memcmp(head, "\177ELF", 4) == 0) {
        snprintf(out, n, "the ELF interpreter (dynamic loader) it names was not found");
    } else {
        snprintf(out, n, "command not found");
    }
    return out;
}

static void exec_command(struct op *op) {
    int pty = num(op, 0);
    char **argv = split(&op->a[1], NULL), **envp = split(&op->a[2], NULL);
    if (!argv[0]) fail(EINVAL, "empty command");
    char buf[PATH_MAX];
    const char *path = find_executable(argv[0], op->a[3].s, buf, sizeof buf);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!own_pid_ns)  /* no pid namespace: the run's orphans come to us, not to the host's init */
        CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "PR_SET_CHILD_SUBREAPER");
    /* Every signal blocked, 32-34 too (libc's sigfillset leaves out those it keeps for
       itself: unblocked, the command could end us with them where no Landlock scope stops
       it, orphaning its processes): raw, as the kernel counts them. */
    sigset_t old;
    uint64_t all = ~(uint64_t)0;
    sigemptyset(&old);
    syscall(SYS_rt_sigprocmask, SIG_BLOCK, &all, &old, sizeof all);
    exec_errno = 0;
    pid_t pid = vfork();
    if (pid == 0) {
        if (pty) setpgid(0, 0); else setsid();
        if (landlock_abi >= 6) {
            /* A domain of the command's own, scoped: it may signal (and reach abstract sockets
               of) its own processes only, not ours nor, without a pid namespace, every other
               process of its uid on the host; we, in the domain above, still signal it. */
            /* Every layer denies REFER (rename and link across directories) unless it handles
               and grants it: this one grants it everywhere, leaving that to the layer above. */
            struct { uint64_t fs, net, scoped; } attr = {LL_FS_REFER, 0, LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL};
            int rs = (int)syscall(SYS_LANDLOCK_CREATE_RULESET, &attr, sizeof attr, 0);
            int root = rs < 0 ? -1 : open("/", O_PATH | O_CLOEXEC);
            struct path_beneath everywhere = {LL_FS_REFER, root};
            if (root < 0 || syscall(SYS_LANDLOCK_ADD_RULE, rs, 1, &everywhere, 0) < 0
                || syscall(SYS_LANDLOCK_RESTRICT_SELF, rs, 0) < 0) {
                exec_errno = errno ? errno : EPERM;
                exec_scope_failed = 1;
                _exit(127);
            }
            close(root);
            close(rs);
        }
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execve(path, argv, envp);
        exec_errno = errno;
        _exit(127);
    }
    if (pid < 0) CHECK(-1, "fork");
    if (exec_errno) {
        int err = exec_errno;
        waitpid(pid, NULL, 0);
        if (exec_scope_failed) {  /* a setup step of its own, not the command failing to start */
            snprintf(step, sizeof step, "landlock_scope");
            sub[0] = 0;
            fail(err, "landlock scope for the command: %s", strerror(err));
        }
        struct stat st;  /* execve says EACCES for a directory: name it, as shells do */
        int dir = err == EACCES && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
        char why[320];
        const char *what = err == 2 ? "command not found" : dir || err == 21 ? "is a directory"
                         : err == 13 ? "permission denied" : err == 8 ? ENOEXEC_WHY
                         : err == 7 ? "argument list too long" : strerror(err);
        if (err == ENOENT && stat(path, &st) == 0 && S_ISREG(st.st_mode))
            what = missing_interpreter(path, why, sizeof why);
        fail(err, "%s: %s", argv[0], what);
    }
    if (pty) {
        tcsetpgrp(0, pid);
        kill(-pid, SIGCONT);  /* in case it stopped on SIGTTIN/SIGTTOU before that */
    }
    if (tracing) {
        mark("", 0);
        trace_len += snprintf(trace_buf + trace_len, sizeof trace_buf - trace_len, " exec=%.4f", ms_since(&t0));
        report("T%s", trace_buf);
    }
    report("S %d", pid);
    /* The signals we act on stay blocked and are taken one at a time with sigwaitinfo, child
       exits (SIGCHLD) with them: none can slip in between a check and a wait, and no work is
       done in a handler. */
    sigset_t waited = old;
    sigemptyset(&waited);
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaddset(&waited, forwarded[i]);
    sigaddset(&waited, SIGCHLD);
    if (!own_pid_ns) sigaddset(&waited, PARENT_GONE);
    /* all stay blocked (see above): those we act on are taken with sigwaitinfo */
    for (;;) {
        int sig = sigwaitinfo(&waited, NULL);
        if (sig < 0) {
            if (errno == EINTR) continue;
            if (!own_pid_ns) kill_tree();  /* nothing may outlive us without a pid namespace */
            _exit(0);
        }
        if (sig == PARENT_GONE) {  /* nobody is left to report to: end the run, then ourselves */
            kill_tree();
            _exit(0);
        }
        if (sig != SIGCHLD) {
            if (own_pid_ns)
                kill(-1, sig);  /* every process we may signal in this pid namespace */
            else
                signal_tree(sig);  /* no pid namespace: kill(-1) would reach every process of the uid on
                                      the host; our descendants instead */
            continue;
        }
        for (;;) {
            int status;
            siginfo_t ready;  /* which child has exited, left unreaped: the command's own CPU
                                 time is read while it is a zombie */
            ready.si_pid = 0;
            int w = waitid(P_ALL, 0, &ready, WEXITED | WNOHANG | WNOWAIT);
            if (w < 0 && errno == EINTR) continue;
            if (w == 0 && ready.si_pid == 0) break;  /* none has exited (not a waitpid(-1) now: it
                                                        could reap the command unread) */
            double own = ready.si_pid == pid ? own_cpu_time(pid) : -1;
            pid_t got = ready.si_pid > 0 ? waitpid(ready.si_pid, &status, 0) : waitpid(-1, &status, WNOHANG);
            if (got < 0 && errno == EINTR) continue;
            if (got < 0) {  /* no child left (or waitpid failed: end what may be left first) */
                if (!own_pid_ns) kill_tree();
                _exit(0);
            }
            if (got == 0) break;
            if (got == pid) {
                if (own_pid_ns) reap_the_rest(); else kill_tree();
                struct rusage ru;
                getrusage(RUSAGE_CHILDREN, &ru);
                report("X %d %ld.%06ld %ld.%06ld %ld %.6f", status, (long)ru.ru_utime.tv_sec, (long)ru.ru_utime.tv_usec,
                       (long)ru.ru_stime.tv_sec, (long)ru.ru_stime.tv_usec, ru.ru_maxrss, own);
                _exit(0);  /* the kernel now kills whatever is left in the namespace */
            }
        }
    }
}

/* ------------------------------------------------------------------------- the loop */

static void run(void) {
    struct op op;
    int skip = 0;
    while (next_op(&op)) {
        if (skip) { skip = 0; continue; }
        const char *a0 = op.nargs > 0 ? op.a[0].s : "";
        const char *a1 = op.nargs > 1 ? op.a[1].s : "";
        switch (op.code) {
        case 'T': mark(a0, op.a[0].n); break;
        case 'q': snprintf(sub, sizeof sub, "%s", a0); break;
        case 'F': fail(num(&op, 0), "%s", a1); break;
        case 's': CHECK(setsid(), "setsid"); break;
        case 'n': prctl(PR_SET_NAME, a0, 0, 0, 0); break;
        case 'd': CHECK(prctl(PR_SET_PDEATHSIG, num(&op, 0), 0, 0, 0), "pdeathsig"); supervised_or_exit(); break;
        case 'u': CHECK(unshare(num(&op, 0)), "unshare"); break;
        case 'e': CHECK(setns(num(&op, 0), num(&op, 1)), "setns"); break;
        case 'c': CHECK(chdir(a0), "chdir '%s'", a0); break;
        case 'C': {  /* the directory we are in must be the one the supervisor checked (device, inode) */
            struct stat st;
            CHECK(stat(".", &st), "stat '%s'", a0);
            if ((uint64_t)st.st_dev != strtoull(a1, NULL, 10) || (uint64_t)st.st_ino != strtoull(op.a[2].s, NULL, 10)) {
                errno = EXDEV;
                CHECK(-1, "%s is no longer the directory that was checked (a path component replaced since)", a0);
            }
            break;
        }
        case 'm':
            no_link_below_root(a1);
            CHECK(mount(str_or_null(&op, 0), a1, str_or_null(&op, 2), num(&op, 3), str_or_null(&op, 4)),
                  "mount %s", a1);
            break;
        case 'o': {  /* open a bind source (O_PATH, no symlink follow) into a slot */
            int k = slot(&op, 0);
            slots[k] = open(a1, O_PATH | O_CLOEXEC | O_NOFOLLOW);
            if (slots[k] < 0 && !num(&op, 2)) CHECK(-1, "'%s'", a1);
            break;
        }
        case 'b': {  /* bind slot -> target: slot, target, writable, device, is_dir */
            int fd = slots[slot(&op, 0)];
            if (fd < 0) break;  /* an optional source that was absent */
            mkpoint(a1, num(&op, 4));
            bind_fd(fd, a1, num(&op, 2), num(&op, 3));
            close(fd);
            slots[slot(&op, 0)] = -1;
            break;
        }
        case 'k': CHECK(mkdir(a0, num(&op, 1)), "mkdir '%s'", a0); break;
        case 'K': mkpoint(a0, num(&op, 1)); break;
        case 'G': slots[slot(&op, 0)] = clone_terminal(); break;
        case 'j': {  /* move the terminal's clone to target: read-only, nosuid, a device */
            int k = slot(&op, 0);
            if (slots[k] >= 0) move_tree(&slots[k], a1, 0, 1);  /* else a terminal this namespace did not show */
            break;
        }
        case 'D': no_link_below_root(a0); if (!is_dir(a0)) CHECK(makedirs(a0, 0755), "'%s'", a0); break;
        case 'Q': snprintf(view_root, sizeof view_root, "%s", a0); break;
        case 'l': {  /* symlink target linkpath [only if absent, creating parents] */
            struct stat st;
            char dir[PATH_MAX];
            snprintf(dir, sizeof dir, "%s", a1);
            char *end = strrchr(dir, '/');
            if (end && end != dir) { *end = 0; no_link_below_root(dir); }  /* (the link itself may exist) */
            if (num(&op, 2)) {
                if (lstat(a1, &st) == 0) break;
                char parent[PATH_MAX];
                snprintf(parent, sizeof parent, "%s", a1);
                char *slash = strrchr(parent, '/');
                if (slash && slash != parent) { *slash = 0; CHECK(makedirs(parent, 0755), "'%s'", parent); }
            }
            CHECK(symlink(a0, a1), "symlink '%s'", a1);
            break;
        }
        case 'w': no_link_below_root(a0); write_file(a0, op.a[2].s, op.a[2].n, num(&op, 1)); break;
        case 'W': {  /* clone the caller's workdir */
            int k = slot(&op, 0);
            slots[k] = syscall(SYS_OPEN_TREE, AT_FDCWD, a1, OPEN_TREE_CLONE | O_CLOEXEC);
            CHECK(slots[k], "open_tree '%s'", a1);
            break;
        }
        case 'V': {  /* the slot must be the directory the supervisor checked (device, inode) */
            struct stat st;
            CHECK(fstat(slots[slot(&op, 0)], &st), "fstat '%s'", a1);
            if ((uint64_t)st.st_dev != strtoull(op.a[2].s, NULL, 10) || (uint64_t)st.st_ino != strtoull(op.a[3].s, NULL, 10)) {
                errno = EXDEV;
                CHECK(-1, "%s is no longer the %s that was checked (a path component replaced since)", a1,
                      S_ISDIR(st.st_mode) ? "directory" : "file");  /* a bind source may be either */
            }
            break;
        }
        case 'I': {  /* idmap a clone onto the run's ids; where the filesystem cannot: fall back or refuse */
            int k = slot(&op, 0), ok = 0, why = 0;
            /* a read-write bind, once the run fell back to its workdir owner's ids: as it is */
            if (num(&op, 6) == 2 && as_owner) break;
            int userns = idmap_userns(num(&op, 2), num(&op, 3), num(&op, 4), num(&op, 5));
            if (userns >= 0) {
                struct mount_attr_s attr = {MOUNT_ATTR_IDMAP, 0, 0, (uint64_t)userns};
                ok = syscall(SYS_MOUNT_SETATTR, slots[k], "", AT_EMPTY_PATH, &attr, sizeof attr) == 0;
                why = errno;
                close(userns);
            }
            if (num(&op, 6) == 2) break;  /* a read-write bind: where it cannot be idmapped, as it is */
            if (!ok && !num(&op, 6)) {  /* the owner is root or a per-run uid: never run as either */
                errno = EPERM;
                CHECK(-1, "cannot idmap %s on this filesystem (%s), and it belongs to root or to a per-run uid: the "
                      "command would run as host uid 0 or as another run; give the directory to an unprivileged owner",
                      a1, strerror(why ? why : EINVAL));
            }
            if (!ok) {  /* no idmapped mounts here: run as the directory's owner, and say so */
                as_owner = 1;
                run_uid = num(&op, 2);
                run_gid = NOGROUP;  /* never the directory's group (shadow, disk, docker...) */
                report("A uid=%d", run_uid);
            }
            break;
        }
        case 'M': move_tree(&slots[slot(&op, 0)], a1, 1, 0); break;  /* a cloned tree: nosuid,nodev */
        case 'X': CHECK(umount2(a0, MNT_DETACH), "umount2 %s", a0); break;
        case 'v': CHECK(mount(a0, a1, NULL, MS_MOVE, NULL), "move %s to %s", a0, a1); break;
        case 'f': CHECK(rmdir(a0), "rmdir '%s'", a0); break;
        case 'r': proc_readonly(a0); break;
        case 'x': proc_mask(a0, a1); break;
        case 'P':
            view_root[0] = 0;  /* from here on links resolve in the view */
            CHECK(chdir(a0), "chdir '%s'", a0);
            CHECK(syscall(SYS_pivot_root, ".", "."), "pivot_root");
            CHECK(umount2(".", MNT_DETACH), "umount2");
            CHECK(chdir("/"), "chdir /");
            break;
        case 'N': loopback_up(); break;
        case 'h': CHECK(sethostname(a0, op.a[0].n), "sethostname"); break;
        case 'g': await_cgroup(num(&op, 0)); break;
        case 't': {
            struct rlimit rl = {(rlim_t)strtoull(a1, NULL, 10), (rlim_t)strtoull(a1, NULL, 10)};
            CHECK(setrlimit(num(&op, 0), &rl), "setrlimit %s", a0);
            break;
        }
        case 'z': close_inherited_fds(); break;
        case 'a': landlock_prepare(&op); break;
        case 'Y': enter_user_namespace(num(&op, 0), num(&op, 1)); break;
        case 'B': drop_bounding_set(num(&op, 0)); break;
        case 'U': {
            int uid = run_uid >= 0 ? run_uid : (int)num(&op, 0), gid = run_gid >= 0 ? run_gid : (int)num(&op, 1);
            CHECK(setgroups(0, NULL), "setgroups");
            CHECK(setresgid(gid, gid, gid), "setresgid");
            CHECK(setresuid(uid, uid, uid), "setresuid");
            break;
        }
        case 'Z': clear_capabilities(); break;
        case 'p':
            CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs");
            CHECK(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable");
            break;
        case 'A':
            if (landlock_rs >= 0) {
                CHECK(syscall(SYS_LANDLOCK_RESTRICT_SELF, landlock_rs, 0), "landlock_restrict_self");
                close(landlock_rs);
                landlock_rs = -1;
            }
            break;
        case 'S': load_seccomp(&op); break;
        case 'y': CHECK(ioctl(0, TIOCSCTTY, 0), "TIOCSCTTY"); break;
        case 'E': exec_command(&op); break;  /* never returns */
        case 'R': tracing = 1; break;
        case 'J':  /* join the run's v1 cgroups: "0" to each hierarchy's tasks file moves this thread
                      alone, which skips the global threadgroup lock a move of another process takes
                      (a full RCU grace period, milliseconds, whenever it was idle) */
            for (int i = 1; i < op.nargs; i++)
                if (write(num(&op, i), "0", 1) < 0) {
                    int e = errno;
                    fail(e, "cannot move the sandbox into %s: %s", a0, strerror(e));
                }
            for (int i = 1; i < op.nargs; i++) close(num(&op, i));
            break;
        case 'H': {  /* a template is built: say so, and hold the namespace until stdin closes */
            char c;
            report("R");
            while (read(0, &c, 1) < 0 && errno == EINTR) {}
            _exit(0);
        }
        default: fail(EINVAL, "unknown stage op %c", op.code);
        }
    }
    fail(EINVAL, "the stage program has no command");
}

/* What a caller's own state would otherwise hand the run: its umask (077 made the view's
   /etc unreadable), its personality (setarch -R: no ASLR), its nice value, I/O class and real-time
   scheduling (untrusted code at the caller's priority). The command starts from defaults. */
static void reset_process_state(void) {
    umask(022);
    if (personality(0xffffffff) != PER_LINUX) personality(PER_LINUX);
    setpriority(PRIO_PROCESS, 0, 0);
    syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, 0, 0);  /* the default class (ionice -c1 is real-time) */
    /* raw syscalls: musl's wrappers answer ENOSYS (POSIX means the process, Linux the thread) */
    if (syscall(SYS_sched_getscheduler, 0) != SCHED_OTHER) {
        struct sched_param sp = {0};
        syscall(SYS_sched_setscheduler, 0, SCHED_OTHER, &sp);
    }
}

/* For a caller that cannot cheaply unshare CLONE_NEWPID itself (Python 3.11 has no os.unshare,
   and the one-shot CLI would load ctypes for it: ~2.5 ms), or that must place PID 1 in a
   cgroup v2 as it is born: PID 1 of a new pid namespace is cloned here as our caller's child
   (CLONE_PARENT), so that it reaps it and holds its pidfd as if it had spawned it; we send its
   pid on PIDNS_FD and exit, and it goes on as the stage. A raw clone with no new stack, as
   bubblewrap does: fork's semantics with namespace flags.
   With INTO_CGROUP_FD, clone3's CLONE_INTO_CGROUP (Linux 5.7) puts PID 1 in the run's cgroup
   from its first instruction: moving a process later (cgroup.procs) takes the global
   threadgroup lock, whose writer waits for an RCU grace period whenever it was idle (5-15 ms
   here). Where clone3 cannot (an older kernel, a container's seccomp profile), the plain clone
   follows and the line says so ("pid" alone): the supervisor then moves PID 1 itself. */
struct clone3_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
        set_tid_size, cgroup;
};
#define CLONE_INTO_CGROUP_FLAG 0x200000000ULL

static void clone_pid_namespace(void) {
    char msg[32];
    long pid = -1;
    int into = fcntl(INTO_CGROUP_FD, F_GETFD) >= 0;
    if (into) {
        struct clone3_args args;
        memset(&args, 0, sizeof args);
        args.flags = CLONE_PARENT | CLONE_NEWPID | CLONE_INTO_CGROUP_FLAG;
        args.cgroup = INTO_CGROUP_FD;
        pid = syscall(SYS_clone3, &args, sizeof args);
        into = pid >= 0;
    }
    if (pid < 0) pid = syscall(SYS_clone, CLONE_PARENT | CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        close(PIDNS_FD);
        close(INTO_CGROUP_FD);
        return;
    }
    int n = snprintf(msg, sizeof msg, pid < 0 ? "%ld\n" : into ? "%ld cgroup\n" : "%ld\n",
                     pid < 0 ? -(long)errno : pid);
    (void)!write(PIDNS_FD, msg, n);
    _exit(0);
}

int main(int argc, char **argv) {
    (void)argc;  /* argv[0] is the mode: /proc/1/cmdline shows it and nothing else */
    for (int i = 0; i < MAX_SLOTS; i++) slots[i] = -1;
    own_pid_ns = argv[0] && strcmp(argv[0], "sandboxrun-init") == 0;
    if (own_pid_ns && fcntl(PIDNS_FD, F_GETFD) >= 0) clone_pid_namespace();
    /* The init mode ends the run with kill(-1): only ever as PID 1 of a pid namespace (in the
       caller's, started by mistake, it would reach every process the caller may signal). */
    if (own_pid_ns && getpid() != 1) fail(EINVAL, "started as a pid namespace's init, but it is not PID 1");
    reset_signals();
    reset_process_state();
    read_program();
    run();
    return 125;
}
