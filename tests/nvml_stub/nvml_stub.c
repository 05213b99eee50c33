/*
 * A stand-in for libnvidia-ml.so.1: the part of NVML's C ABI that greend calls,
 * in front of N simulated H100-like GPUs, with faults chosen by environment
 * variables. The real pynvml loads it (LD_LIBRARY_PATH=build/nvml_stub), so the
 * bindings' ctypes declarations, NVML's units (mW, mJ, MHz), the two-call size
 * protocol of the clock lists, opaque handles and one process-wide init count
 * are all exercised as on a real node.
 *
 * Environment (read at the first nvmlInit; lists are comma-separated GPU indices):
 *   NVML_STUB_GPUS=8                 number of GPUs
 *   NVML_STUB_STATE=path             power limits and locked clocks kept in this
 *                                    file across processes (as a GPU keeps them)
 *   NVML_STUB_INIT_ERROR=code        nvmlInit returns this code (9, 12, 18...)
 *   NVML_STUB_LOST=1,3               every call on these GPUs: GPU_IS_LOST
 *   NVML_STUB_NO_PERMISSION=all|0,2  setters: NO_PERMISSION
 *   NVML_STUB_NO_LOCKED_CLOCKS=...   Set/ResetGpuLockedClocks: NOT_SUPPORTED (a
 *                                    consumer card); the power limit still works
 *   NVML_STUB_NO_ENERGY=...          GetTotalEnergyConsumption: NOT_SUPPORTED
 *   NVML_STUB_RESET_REQUIRED=...     every call on these GPUs: RESET_REQUIRED
 *   NVML_STUB_MIG=...                MIG mode on (no clock locks, no utilisation, no GPM)
 *   NVML_STUB_PRE_HOPPER=...         these GPUs model an A100 (compute capability 8.0):
 *                                    no GPM (see the GPM section below)
 *   NVML_STUB_PERSISTENCE_OFF=1      persistence mode reads disabled
 *   NVML_STUB_HANG=fn[:gpu]          that call (e.g. nvmlDeviceGetPowerUsage)
 *                                    sleeps NVML_STUB_HANG_S seconds (default: forever)
 *   NVML_STUB_HANG_GPUS=all|3,5      every call on these GPUs (GetHandleByIndex of
 *                                    them included) sleeps NVML_STUB_HANG_S seconds
 *   NVML_STUB_HANG_NODE=1            every node-wide call (GetCount, GetDriverVersion,
 *                                    GetHandleByUUID) does too: with HANG_GPUS=all,
 *                                    every NVML call but nvmlInit and nvmlShutdown hangs
 *   NVML_STUB_HANG_WHEN=path         HANG_GPUS and HANG_NODE hang only while this file
 *                                    exists (a GPU that starts hanging mid-run)
 *   NVML_STUB_FAIL=fn:gpu:n          every n-th call of fn on that GPU answers
 *                                    NVML_ERROR_UNKNOWN (a transient fault)
 *   NVML_STUB_INIT_S=s               nvmlInit takes this long (as after a driver load)
 *   NVML_STUB_REINIT_S=s             every nvmlInit but the process's first takes this
 *                                    long (NVML initialised again after a driver load)
 *   NVML_STUB_CLOCK_CLAMP=mhz        SetGpuLockedClocks holds at most this max clock
 *                                    (the driver clamps the request); the SM clock and
 *                                    the clocks-event reasons show what is held
 *   NVML_STUB_IDLE=all|0,2           these GPUs run no work: the SM clock drops to the
 *                                    lowest the lock allows (345 MHz unlocked), the
 *                                    clocks-event reasons say GpuIdle (0x1), no load
 *   NVML_STUB_IDLE_WHEN=path         IDLE holds only while this file exists
 *   NVML_STUB_SLOW_MS=ms             every call sleeps this long first
 *   NVML_STUB_UNINIT_AFTER=n         after n calls the init count drops to 0 (as
 *                                    after someone's unbalanced nvmlShutdown)
 *   NVML_STUB_RESET=gpu:n[:down]     after n calls the GPU resets: its handles go
 *                                    stale (GPU_IS_LOST), GetHandleByIndex answers
 *                                    GPU_IS_LOST `down` more times (default 2), then
 *                                    a fresh handle works; energy restarts from 0
 *                                    and the settings go back to their defaults
 *
 * A busy GPU runs at its locked max clock (the top clock unlocked), unless the power
 * limit holds it lower: then it runs at the highest supported clock whose power fits
 * the limit and the reasons say SwPowerCap (0x4), as a real GPU's do; a lock below the
 * top that holds the clock shows as ApplicationsClocksSetting (0x2).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_RESET_REQUIRED 16
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 64
#define MAGIC 0x4e564d4cu
#define N_SM_CLOCKS 110 /* 1980 down to 345 MHz in 15 MHz steps */
#define MEM_CLOCK 2619
#define SM_MAX 1980
#define LIMIT_MIN 200000u
#define LIMIT_MAX 700000u
#define LIMIT_DEFAULT 700000u
#define IDLE_MW 70000.0

typedef struct stub_device {
    unsigned magic;
    int gpu;
    int gen;
} stub_device;
typedef stub_device *nvmlDevice_t;

typedef struct {
    unsigned gpu, memory;
} nvmlUtilization_t;

typedef struct {
    int gen;            /* handles of older generations are stale */
    int down;           /* GetHandleByIndex answers GPU_IS_LOST this many more times */
    unsigned limit_mw;
    unsigned lock_min, lock_max; /* 0: unlocked */
    double energy_mj;
    double last_s;
    int lost, no_perm, no_lock, no_energy, reset_required, mig, hang, idle, pre_hopper;
    double sm_active_s, sm_last_s; /* GPM: SM-busy seconds so far (SMs busy x time), when booked */
} gpu_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int configured = 0;
static int init_count = 0;
/* GPM samples live within one NVML session (see the GPM section): the session's number,
   the samples allocated in it and not freed, the frees of an unknown or ended sample. */
static int gpm_session = 0;
static long gpm_live = 0, gpm_bad_frees = 0;

/* The init count drops to 0 (the last nvmlShutdown, or NVML_STUB_UNINIT_AFTER): the
   session ends, and so do its GPM samples. Called with mu held. */
static void end_session(void) {
    init_count = 0;
    gpm_session++;
    gpm_live = 0;
}
static int n_gpus = 8;
static gpu_t gpus[MAX_GPUS];
static const char *state_path = NULL;
static int init_error = 0;
static int persistence = 1;
static char hang_fn[128] = "";
static int hang_gpu = -1;
static char fail_fn[128] = "";
static int fail_gpu = -1;
static long fail_every = 0, fail_calls = 0;
static double hang_s = -1;
static long slow_ms = 0;
static int hang_node = 0;
static const char *hang_when = NULL;
static const char *idle_when = NULL;
static double init_s = 0;
static double reinit_s = 0;
static long inits = 0; /* nvmlInit calls so far */
static unsigned clock_clamp = 0;
static long uninit_after = -1;
static int reset_gpu = -1;
static long reset_after = -1;
static int reset_down = 2;
static long calls = 0;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void mark_list(const char *env, size_t off) {
    const char *v = getenv(env);
    if (!v || !*v) return;
    if (strcmp(v, "all") == 0) {
        for (int i = 0; i < MAX_GPUS; i++) *(int *)((char *)&gpus[i] + off) = 1;
        return;
    }
    char *copy = strdup(v), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int i = atoi(tok);
        if (i >= 0 && i < MAX_GPUS) *(int *)((char *)&gpus[i] + off) = 1;
    }
    free(copy);
}

static void load_state(void) {
    if (!state_path) return;
    FILE *f = fopen(state_path, "r");
    if (!f) return;
    int i;
    unsigned lim, lo, hi;
    while (fscanf(f, "%d %u %u %u", &i, &lim, &lo, &hi) == 4)
        if (i >= 0 && i < n_gpus) {
            gpus[i].limit_mw = lim;
            gpus[i].lock_min = lo;
            gpus[i].lock_max = hi;
        }
    fclose(f);
}

static void save_state(void) {
    if (!state_path) return;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", state_path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    for (int i = 0; i < n_gpus; i++)
        fprintf(f, "%d %u %u %u\n", i, gpus[i].limit_mw, gpus[i].lock_min, gpus[i].lock_max);
    fclose(f);
    rename(tmp, state_path);
}

static void configure(void) {
    if (configured) return;
    configured = 1;
    const char *v;
    if ((v = getenv("NVML_STUB_GPUS"))) n_gpus = atoi(v);
    if (n_gpus < 0) n_gpus = 0;
    if (n_gpus > MAX_GPUS) n_gpus = MAX_GPUS;
    double t = now_s();
    for (int i = 0; i < MAX_GPUS; i++) {
        memset(&gpus[i], 0, sizeof gpus[i]);
        gpus[i].limit_mw = LIMIT_DEFAULT;
        gpus[i].last_s = t;
        gpus[i].sm_last_s = t;
        gpus[i].energy_mj = 1e6 * (i + 1); /* counters since driver load differ per GPU */
    }
    state_path = getenv("NVML_STUB_STATE");
    load_state();
    if ((v = getenv("NVML_STUB_INIT_ERROR"))) init_error = atoi(v);
    if ((v = getenv("NVML_STUB_PERSISTENCE_OFF")) && *v && *v != '0') persistence = 0;
    mark_list("NVML_STUB_LOST", offsetof(gpu_t, lost));
    mark_list("NVML_STUB_NO_PERMISSION", offsetof(gpu_t, no_perm));
    mark_list("NVML_STUB_NO_LOCKED_CLOCKS", offsetof(gpu_t, no_lock));
    mark_list("NVML_STUB_NO_ENERGY", offsetof(gpu_t, no_energy));
    mark_list("NVML_STUB_RESET_REQUIRED", offsetof(gpu_t, reset_required));
    mark_list("NVML_STUB_MIG", offsetof(gpu_t, mig));
    mark_list("NVML_STUB_PRE_HOPPER", offsetof(gpu_t, pre_hopper));
    if ((v = getenv("NVML_STUB_HANG")) && *v) {
        snprintf(hang_fn, sizeof hang_fn, "%s", v);
        char *colon = strchr(hang_fn, ':');
        if (colon) {
            *colon = 0;
            hang_gpu = atoi(colon + 1);
        }
    }
    if ((v = getenv("NVML_STUB_FAIL")) && *v) {
        char spec[128];
        snprintf(spec, sizeof spec, "%s", v);
        char *a = strchr(spec, ':'), *b = a ? strchr(a + 1, ':') : NULL;
        if (a && b) {
            *a = *b = 0;
            snprintf(fail_fn, sizeof fail_fn, "%s", spec);
            fail_gpu = atoi(a + 1);
            fail_every = atol(b + 1);
        }
    }
    if ((v = getenv("NVML_STUB_HANG_S"))) hang_s = atof(v);
    if ((v = getenv("NVML_STUB_SLOW_MS"))) slow_ms = atol(v);
    mark_list("NVML_STUB_HANG_GPUS", offsetof(gpu_t, hang));
    mark_list("NVML_STUB_IDLE", offsetof(gpu_t, idle));
    if ((v = getenv("NVML_STUB_IDLE_WHEN")) && *v) idle_when = v;
    if ((v = getenv("NVML_STUB_HANG_NODE")) && *v && *v != '0') hang_node = 1;
    if ((v = getenv("NVML_STUB_HANG_WHEN")) && *v) hang_when = v;
    if ((v = getenv("NVML_STUB_INIT_S"))) init_s = atof(v);
    if ((v = getenv("NVML_STUB_REINIT_S"))) reinit_s = atof(v);
    if ((v = getenv("NVML_STUB_CLOCK_CLAMP"))) clock_clamp = (unsigned)atoi(v);
    if ((v = getenv("NVML_STUB_UNINIT_AFTER"))) uninit_after = atol(v);
    if ((v = getenv("NVML_STUB_RESET")) && *v) {
        int g = -1, d = 2;
        long n = -1;
        if (sscanf(v, "%d:%ld:%d", &g, &n, &d) >= 2) {
            reset_gpu = g;
            reset_after = n;
            reset_down = d;
        }
    }
}

static void sleep_s(double s) {
    if (s < 0)
        for (;;) sleep(3600);
    usleep((useconds_t)(s * 1e6));
}

/* Outside the lock: a hung or slow call must not stop calls from other threads
   (on a real node one stuck GPU leaves the others' calls answering). gpu -1: a
   node-wide call, -2 nvmlInit (which HANG_NODE leaves alone). */
static void maybe_wait(const char *fn, int gpu) {
    if (slow_ms > 0) usleep((useconds_t)slow_ms * 1000);
    int hung = gpu >= 0 && gpu < MAX_GPUS ? gpus[gpu].hang : (gpu == -1 && hang_node);
    if (hung && (!hang_when || access(hang_when, F_OK) == 0)) sleep_s(hang_s);
    if (hang_fn[0] && strcmp(hang_fn, fn) == 0 && (hang_gpu < 0 || hang_gpu == gpu)) {
        if (hang_s < 0)
            for (;;) sleep(3600);
        usleep((useconds_t)(hang_s * 1e6));
    }
}

/* Counts calls; fires the mid-run faults. Called with mu held. */
static void tick(void) {
    calls++;
    if (uninit_after >= 0 && calls == uninit_after) end_session();
    if (reset_gpu >= 0 && reset_gpu < n_gpus && calls == reset_after) {
        gpu_t *g = &gpus[reset_gpu];
        g->gen++;
        g->down = reset_down;
        g->energy_mj = 0;
        g->last_s = g->sm_last_s = now_s();
        g->sm_active_s = 0; /* the GPM counters restart too */
        g->limit_mw = LIMIT_DEFAULT;
        g->lock_min = g->lock_max = 0;
        save_state();
    }
}

#define SM_MIN (SM_MAX - 15 * (N_SM_CLOCKS - 1))
#define REASON_IDLE 0x1ull
#define REASON_CLOCK_SETTING 0x2ull
#define REASON_SW_POWER_CAP 0x4ull

static int is_idle(const gpu_t *g) { return g->idle && (!idle_when || access(idle_when, F_OK) == 0); }

static double busy_mw(unsigned mhz) { return IDLE_MW + 230000.0 * mhz / SM_MAX; }

/* The highest supported clock whose busy power fits the power limit. */
static unsigned power_fit_clock(const gpu_t *g) {
    unsigned mhz = SM_MAX;
    while (mhz > SM_MIN && busy_mw(mhz) > g->limit_mw) mhz -= 15;
    return mhz;
}

/* The SM clock now, and why (the clocks-event reasons' bits). */
static unsigned sm_clock_why(const gpu_t *g, unsigned long long *why) {
    unsigned top = g->lock_max ? g->lock_max : SM_MAX;
    if (is_idle(g)) {
        *why = REASON_IDLE;
        return g->lock_min > SM_MIN ? g->lock_min : SM_MIN;
    }
    unsigned fit = power_fit_clock(g);
    if (fit < top) {
        *why = REASON_SW_POWER_CAP;
        return fit;
    }
    *why = top < SM_MAX ? REASON_CLOCK_SETTING : 0ull;
    return top;
}

static unsigned sm_clock(const gpu_t *g) {
    unsigned long long why;
    return sm_clock_why(g, &why);
}

static double power_mw(const gpu_t *g) {
    if (is_idle(g)) return IDLE_MW;
    double p = busy_mw(sm_clock(g));
    return p > g->limit_mw ? g->limit_mw : p;
}

static void advance(gpu_t *g) {
    double t = now_s();
    g->energy_mj += power_mw(g) * (t - g->last_s);
    g->last_s = t;
}

/* Checks init and the handle; on success *out is the GPU (mu held on return
   only when NVML_SUCCESS). */
static nvmlReturn_t enter(const char *fn, nvmlDevice_t h, gpu_t **out) {
    int gi = (h && h->magic == MAGIC) ? h->gpu : -1;
    maybe_wait(fn, gi);
    pthread_mutex_lock(&mu);
    tick();
    nvmlReturn_t r = NVML_SUCCESS;
    if (init_count == 0)
        r = NVML_ERROR_UNINITIALIZED;
    else if (gi < 0 || gi >= n_gpus)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else if (gpus[gi].lost || h->gen != gpus[gi].gen)
        r = NVML_ERROR_GPU_IS_LOST;
    else if (gpus[gi].reset_required)
        r = NVML_ERROR_RESET_REQUIRED;
    else if (fail_every > 0 && gi == fail_gpu && strcmp(fn, fail_fn) == 0 && ++fail_calls % fail_every == 0)
        r = NVML_ERROR_UNKNOWN;
    if (r != NVML_SUCCESS) {
        pthread_mutex_unlock(&mu);
        return r;
    }
    *out = &gpus[gi];
    return NVML_SUCCESS;
}

#define LEAVE(r)                     \
    do {                             \
        pthread_mutex_unlock(&mu);   \
        return (r);                  \
    } while (0)

#define DEVICE_CALL(name)                          \
    gpu_t *g;                                      \
    nvmlReturn_t _r = enter(name, device, &g);     \
    if (_r != NVML_SUCCESS) return _r;

/* ---- init and system */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&mu);
    configure();
    double wait_s = inits++ ? (reinit_s > 0 ? reinit_s : init_s) : init_s;
    pthread_mutex_unlock(&mu);
    if (wait_s > 0) usleep((useconds_t)(wait_s * 1e6));
    maybe_wait("nvmlInit", -2);
    pthread_mutex_lock(&mu);
    if (init_error) LEAVE(init_error);
    init_count++;
    LEAVE(NVML_SUCCESS);
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    if (init_count > 0 && --init_count == 0) end_session(); /* an extra shutdown is not an error */
    LEAVE(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 12: return "NVML Shared Library Not Found";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "Resource in use";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_str(const char *s, char *buf, unsigned len) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, s);
    return NVML_SUCCESS;
}

static nvmlReturn_t node_enter_gpu(const char *fn, int gpu) {
    maybe_wait(fn, gpu);
    pthread_mutex_lock(&mu);
    tick();
    if (init_count == 0) {
        pthread_mutex_unlock(&mu);
        return NVML_ERROR_UNINITIALIZED;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t node_enter(const char *fn) { return node_enter_gpu(fn, -1); }

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = node_enter("nvmlSystemGetDriverVersion");
    if (r) return r;
    LEAVE(copy_str("550.54.15", version, length));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t r = node_enter("nvmlSystemGetNVMLVersion");
    if (r) return r;
    LEAVE(copy_str("12.550.54.15", version, length));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t r = node_enter("nvmlDeviceGetCount");
    if (r) return r;
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned)n_gpus;
    LEAVE(NVML_SUCCESS);
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

static nvmlDevice_t new_handle(int i) {
    /* A fresh object per call: two handles of one GPU are different pointers.
       Never freed, so a stale handle stays readable memory. */
    stub_device *d = malloc(sizeof *d);
    d->magic = MAGIC;
    d->gpu = i;
    d->gen = gpus[i].gen;
    return d;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t r = node_enter_gpu("nvmlDeviceGetHandleByIndex", index < MAX_GPUS ? (int)index : -1);
    if (r) return r;
    if (!device || index >= (unsigned)n_gpus) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    gpu_t *g = &gpus[index];
    if (g->lost) LEAVE(NVML_ERROR_GPU_IS_LOST);
    if (g->down > 0) {
        g->down--;
        LEAVE(NVML_ERROR_GPU_IS_LOST);
    }
    *device = new_handle((int)index);
    LEAVE(NVML_SUCCESS);
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static void uuid_of(int i, char *buf, size_t len) {
    snprintf(buf, len, "GPU-5ab1e000-0000-4000-8000-%012d", i);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t r = node_enter("nvmlDeviceGetHandleByUUID");
    if (r) return r;
    if (!uuid || !device) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < n_gpus; i++) {
        char u[96];
        uuid_of(i, u, sizeof u);
        if (strcmp(u, uuid) == 0) {
            if (gpus[i].lost || gpus[i].down > 0) LEAVE(NVML_ERROR_GPU_IS_LOST);
            *device = new_handle(i);
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

/* ---- per device */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_CALL("nvmlDeviceGetIndex");
    *index = (unsigned)(g - gpus);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL("nvmlDeviceGetName");
    LEAVE(copy_str("NVIDIA H100 80GB HBM3", name, length));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL("nvmlDeviceGetUUID");
    char u[96];
    uuid_of((int)(g - gpus), u, sizeof u);
    LEAVE(copy_str(u, uuid, length));
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEVICE_CALL("nvmlDeviceGetCudaComputeCapability");
    *major = g->no_energy ? 6 : g->pre_hopper ? 8 : 9;
    *minor = 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    DEVICE_CALL("nvmlDeviceGetTotalEnergyConsumption");
    if (g->no_energy) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    advance(g);
    *energy = (unsigned long long)g->energy_mj;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE_CALL("nvmlDeviceGetPowerUsage");
    advance(g);
    *power = (unsigned)power_mw(g);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    DEVICE_CALL("nvmlDeviceGetClockInfo");
    if (type == 2) *clock = MEM_CLOCK;
    else if (type == 0 || type == 1) *clock = sm_clock(g);
    else if (type == 3) *clock = 1755;
    else LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    DEVICE_CALL("nvmlDeviceGetMaxClockInfo");
    if (type == 2) *clock = MEM_CLOCK;
    else if (type == 0 || type == 1) *clock = SM_MAX;
    else if (type == 3) *clock = 1755;
    else LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t device, unsigned int *count, unsigned int *clocks) {
    DEVICE_CALL("nvmlDeviceGetSupportedMemoryClocks");
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (*count < 1 || !clocks) {
        *count = 1;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *count = 1;
    clocks[0] = MEM_CLOCK;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t device, unsigned int mem, unsigned int *count,
                                                  unsigned int *clocks) {
    DEVICE_CALL("nvmlDeviceGetSupportedGraphicsClocks");
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (mem != MEM_CLOCK) LEAVE(NVML_ERROR_NOT_FOUND);
    if (*count < N_SM_CLOCKS || !clocks) {
        *count = N_SM_CLOCKS;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *count = N_SM_CLOCKS;
    for (int i = 0; i < N_SM_CLOCKS; i++) clocks[i] = SM_MAX - 15 * i;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *lo, unsigned int *hi) {
    DEVICE_CALL("nvmlDeviceGetPowerManagementLimitConstraints");
    *lo = LIMIT_MIN;
    *hi = LIMIT_MAX;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL("nvmlDeviceGetPowerManagementDefaultLimit");
    *limit = LIMIT_DEFAULT;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL("nvmlDeviceGetPowerManagementLimit");
    *limit = g->limit_mw;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL("nvmlDeviceGetEnforcedPowerLimit");
    *limit = g->limit_mw;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    DEVICE_CALL("nvmlDeviceGetUtilizationRates");
    if (g->mig) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    util->gpu = is_idle(g) ? 0 : 97;
    util->memory = is_idle(g) ? 0 : 41;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    DEVICE_CALL("nvmlDeviceGetTemperature");
    if (sensor != 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = 38 + (unsigned)(power_mw(g) / 20000.0);
    LEAVE(NVML_SUCCESS);
}

/* What holds the clocks now: idle (GpuIdle, 0x1), the power limit (SwPowerCap, 0x4),
   or the locked clocks (ApplicationsClocksSetting, 0x2) when a lock below the top holds. */
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    DEVICE_CALL("nvmlDeviceGetCurrentClocksEventReasons");
    if (!reasons) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    sm_clock_why(g, reasons);
    LEAVE(NVML_SUCCESS);
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    DEVICE_CALL("nvmlDeviceGetMigMode");
    *current = *pending = g->mig ? 1 : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
    DEVICE_CALL("nvmlDeviceGetPersistenceMode");
    *mode = persistence;
    LEAVE(NVML_SUCCESS);
}

/* ---- setters */

nvmlReturn_t nvmlDeviceSetGpuLockedClocks(nvmlDevice_t device, unsigned int lo, unsigned int hi) {
    DEVICE_CALL("nvmlDeviceSetGpuLockedClocks");
    if (g->no_perm) LEAVE(NVML_ERROR_NO_PERMISSION);
    if (g->no_lock || g->mig) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    if (lo > hi || hi == 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    advance(g);
    g->lock_min = lo;
    g->lock_max = hi > SM_MAX ? SM_MAX : hi;
    if (clock_clamp && g->lock_max > clock_clamp) g->lock_max = clock_clamp; /* the driver's clamp */
    if (g->lock_min > g->lock_max) g->lock_min = g->lock_max;
    save_state();
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceResetGpuLockedClocks(nvmlDevice_t device) {
    DEVICE_CALL("nvmlDeviceResetGpuLockedClocks");
    if (g->no_perm) LEAVE(NVML_ERROR_NO_PERMISSION);
    if (g->no_lock || g->mig) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    advance(g);
    g->lock_min = g->lock_max = 0;
    save_state();
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t device, unsigned int limit) {
    DEVICE_CALL("nvmlDeviceSetPowerManagementLimit");
    if (g->no_perm) LEAVE(NVML_ERROR_NO_PERMISSION);
    if (limit < LIMIT_MIN || limit > LIMIT_MAX) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    advance(g);
    g->limit_mw = limit;
    save_state();
    LEAVE(NVML_SUCCESS);
}

/* ---- for tests: what a GPU has now (there is no NVML getter for locked clocks) */

int nvmlStubGetLockedClocks(unsigned int index, unsigned int *lo, unsigned int *hi) {
    pthread_mutex_lock(&mu);
    configure();
    if (index >= (unsigned)n_gpus) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *lo = gpus[index].lock_min;
    *hi = gpus[index].lock_max;
    LEAVE(NVML_SUCCESS);
}

/* ---- running processes (nvmlDevice{Compute,Graphics,MPSCompute}RunningProcesses)
 *
 * Environment (read at every call, so a test can change who runs where mid-run):
 *   NVML_STUB_PROCS=path        lines "gpu pid [compute|graphics|mps] [used_mib]"
 *                               (default kind compute, memory 0): the processes on each
 *                               GPU. As the driver drops an exited process's context, a
 *                               pid that no longer exists is not listed.
 *   NVML_STUB_NO_PROCS=all|0,2  these lists answer NOT_SUPPORTED on these GPUs
 *
 * The three ABI variants pynvml calls: the unversioned name fills nvmlProcessInfo_v1_t
 * (pid, usedGpuMemory); _v2 and _v3 fill nvmlProcessInfo_v2_t (plus gpuInstanceId and
 * computeInstanceId, 0xFFFFFFFF off MIG). The size protocol is NVML's: *count in is the
 * room in infos; with too little room (or infos NULL) *count out is the number needed
 * and the call returns INSUFFICIENT_SIZE, except that no process at all is SUCCESS with
 * *count 0.
 */
#include <errno.h>
#include <signal.h>

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

#define STUB_MAX_PROCS 256

static int procs_unsupported(int gi) {
    const char *v = getenv("NVML_STUB_NO_PROCS");
    if (!v || !*v) return 0;
    if (strcmp(v, "all") == 0) return 1;
    char *copy = strdup(v), *save = NULL;
    int hit = 0;
    for (char *tok = strtok_r(copy, ",", &save); tok && !hit; tok = strtok_r(NULL, ",", &save))
        hit = atoi(tok) == gi;
    free(copy);
    return hit;
}

/* The live processes of `kind` on GPU gi: pids[] and bytes[], their number returned. */
static unsigned read_procs(int gi, const char *kind, unsigned *pids, unsigned long long *bytes) {
    const char *path = getenv("NVML_STUB_PROCS");
    if (!path || !*path) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned n = 0;
    char line[256];
    while (n < STUB_MAX_PROCS && fgets(line, sizeof line, f)) {
        int g = -1;
        unsigned pid = 0;
        char k[16] = "compute";
        double mib = 0;
        if (sscanf(line, "%d %u %15s %lf", &g, &pid, k, &mib) < 2 || g != gi || pid == 0) continue;
        if (strcmp(k, kind) != 0) continue;
        if (kill((pid_t)pid, 0) != 0 && errno != EPERM) continue; /* exited: its context is gone */
        pids[n] = pid;
        bytes[n] = (unsigned long long)(mib * 1048576.0);
        n++;
    }
    fclose(f);
    return n;
}

static nvmlReturn_t running_processes(const char *fn, const char *kind, nvmlDevice_t device, unsigned int *count,
                                      void *infos, int version) {
    DEVICE_CALL(fn);
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (procs_unsupported(device->gpu)) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    unsigned pids[STUB_MAX_PROCS];
    unsigned long long bytes[STUB_MAX_PROCS];
    unsigned n = read_procs(device->gpu, kind, pids, bytes);
    if (n == 0) {
        *count = 0;
        LEAVE(NVML_SUCCESS);
    }
    if (!infos || *count < n) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned i = 0; i < n; i++) {
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = pids[i];
            p->usedGpuMemory = bytes[i];
        } else {
            nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
            p->pid = pids[i];
            p->usedGpuMemory = bytes[i];
            p->gpuInstanceId = 0xFFFFFFFFu;
            p->computeInstanceId = 0xFFFFFFFFu;
        }
    }
    *count = n;
    LEAVE(NVML_SUCCESS);
}

#define RUNNING_PROCESSES(name, kind, version)                                               \
    nvmlReturn_t name(nvmlDevice_t device, unsigned int *count, void *infos) {               \
        return running_processes(#name, kind, device, count, infos, version);                 \
    }

RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses, "compute", 1)
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses_v2, "compute", 2)
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses_v3, "compute", 3)
RUNNING_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses, "graphics", 1)
RUNNING_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v2, "graphics", 2)
RUNNING_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v3, "graphics", 3)
RUNNING_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses, "mps", 1)
RUNNING_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v2, "mps", 2)
RUNNING_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v3, "mps", 3)

/* ---- GPM: GPU performance monitoring (nvmlGpm*, Hopper and newer)
 *
 * The structs and version numbers are nvml.h's: nvmlGpmSupport_t {version,
 * isSupportedDevice} at NVML_GPM_SUPPORT_VERSION 1; nvmlGpmMetricsGet_t {version,
 * numMetrics, sample1, sample2, metrics[NVML_GPM_METRIC_MAX]} at
 * NVML_GPM_METRICS_GET_VERSION 1, each nvmlGpmMetric_t {metricId, nvmlReturn, value,
 * metricInfo {shortName, longName, unit}}. A sample is an opaque buffer the library
 * allocates; nvmlGpmSampleGet fills it with the device's counters; nvmlGpmMetricsGet
 * computes each metric over the time between two samples of one device.
 *
 * What the stand-in models: NVML_GPM_METRIC_SM_UTIL (percent of the SMs busy over the
 * interval); any other metric answers NOT_SUPPORTED in its own nvmlReturn.
 * A GPU configured pre-Hopper (NVML_STUB_PRE_HOPPER, or pre-Volta: NVML_STUB_NO_ENERGY)
 * reads isSupportedDevice 0 and its samples NOT_SUPPORTED; so do a MIG-mode GPU's
 * whole-device samples (nvmlGpmMigSampleGet is for its instances, of which the stand-in
 * has none: NOT_FOUND). A wrong struct version is INVALID_ARGUMENT, as are samples not
 * filled, of two devices, of two generations of one device (a reset between them) or
 * in the wrong order.
 * nvml.h does not say that a sample outlives nvmlShutdown; the stand-in takes the strict
 * reading: the session's end (the init count down to 0) ends its samples, and using or
 * freeing one after it is INVALID_ARGUMENT (counted: nvmlStubGpmBadFrees) where the real
 * library might crash.
 *
 * Environment:
 *   NVML_STUB_SM_ACTIVE=0:97,1:40    each GPU's SM activity in percent (default 97 busy,
 *                                    0 idle); or a path to a file of "gpu percent" lines,
 *                                    read at every sample (a test changes it mid-run).
 *                                    utilization.gpu does not follow it: a GPU that
 *                                    only waits in NCCL's few-CTA kernels reads 97 there
 *   NVML_STUB_GPM_ERROR=code[:gpu]   nvmlGpmSampleGet answers this code (all GPUs, or one)
 *   NVML_STUB_GPM_ERROR_WHEN=path    ... only while this file exists (an error mid-run)
 * nvmlStubGpmLiveSamples() says how many samples of this session are allocated and not
 * freed; nvmlStubGpmBadFrees() how many frees were of a sample freed or ended before.
 */
#define NVML_GPM_METRIC_SM_UTIL 2
#define NVML_GPM_METRIC_MAX 98 /* nvml.h r525-r550; newer headers allow more metrics */
#define NVML_GPM_METRICS_GET_VERSION 1
#define NVML_GPM_SUPPORT_VERSION 1
#define GPM_MAGIC 0x47504d53u

typedef struct stub_gpm_sample {
    unsigned magic;
    int session, gpu, gen, filled;
    double t_s, sm_active_s;
} stub_gpm_sample;
typedef stub_gpm_sample *nvmlGpmSample_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct {
        char *shortName;
        char *longName;
        char *unit;
    } metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[NVML_GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

static int gpm_device(const gpu_t *g) { return !g->pre_hopper && !g->no_energy; }

static int valid_sample(const stub_gpm_sample *s) { return s && s->magic == GPM_MAGIC && s->session == gpm_session; }

/* GPU gi's SM activity now, in percent. */
static double sm_active_pct(int gi, const gpu_t *g) {
    double pct = is_idle(g) ? 0.0 : 97.0;
    const char *v = getenv("NVML_STUB_SM_ACTIVE");
    if (!v || !*v) return pct;
    if (v[0] == '/') {
        FILE *f = fopen(v, "r");
        if (!f) return pct;
        int i;
        double p;
        while (fscanf(f, "%d %lf", &i, &p) == 2)
            if (i == gi) pct = p;
        fclose(f);
        return pct;
    }
    char *copy = strdup(v), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int i;
        double p;
        if (sscanf(tok, "%d:%lf", &i, &p) == 2 && i == gi) pct = p;
    }
    free(copy);
    return pct;
}

/* The error NVML_STUB_GPM_ERROR asks of GPU gi's samples now (0: none). */
static nvmlReturn_t gpm_fault(int gi) {
    const char *v = getenv("NVML_STUB_GPM_ERROR");
    if (!v || !*v) return NVML_SUCCESS;
    const char *when = getenv("NVML_STUB_GPM_ERROR_WHEN");
    if (when && *when && access(when, F_OK) != 0) return NVML_SUCCESS;
    int code = 0, gpu = -1;
    if (sscanf(v, "%d:%d", &code, &gpu) < 1) return NVML_SUCCESS;
    return gpu < 0 || gpu == gi ? code : NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport) {
    DEVICE_CALL("nvmlGpmQueryDeviceSupport");
    if (!gpmSupport || gpmSupport->version != NVML_GPM_SUPPORT_VERSION) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    gpmSupport->isSupportedDevice = gpm_device(g) ? 1 : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample) {
    nvmlReturn_t r = node_enter("nvmlGpmSampleAlloc");
    if (r) return r;
    if (!gpmSample) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    stub_gpm_sample *s = calloc(1, sizeof *s);
    s->magic = GPM_MAGIC;
    s->session = gpm_session;
    s->gpu = -1;
    *gpmSample = s;
    gpm_live++;
    LEAVE(NVML_SUCCESS);
}

/* A freed sample's memory is kept (its magic cleared): a second free, or a use after
   the free, is INVALID_ARGUMENT rather than a crash. */
nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample) {
    pthread_mutex_lock(&mu);
    if (!valid_sample(gpmSample)) {
        gpm_bad_frees++;
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    }
    gpmSample->magic = 0;
    gpm_live--;
    LEAVE(NVML_SUCCESS);
}

static nvmlReturn_t gpm_sample(gpu_t *g, nvmlGpmSample_t s) {
    int gi = (int)(g - gpus);
    if (!valid_sample(s)) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpm_device(g) || g->mig) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t fault = gpm_fault(gi);
    if (fault) return fault;
    double t = now_s();
    g->sm_active_s += sm_active_pct(gi, g) / 100.0 * (t - g->sm_last_s);
    g->sm_last_s = t;
    s->gpu = gi;
    s->gen = g->gen;
    s->filled = 1;
    s->t_s = t;
    s->sm_active_s = g->sm_active_s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample) {
    DEVICE_CALL("nvmlGpmSampleGet");
    LEAVE(gpm_sample(g, gpmSample));
}

nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t gpmSample) {
    DEVICE_CALL("nvmlGpmMigSampleGet");
    (void)gpuInstanceId;
    if (!valid_sample(gpmSample)) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (!gpm_device(g) || !g->mig) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    LEAVE(NVML_ERROR_NOT_FOUND); /* no GPU instances are modelled */
}

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) {
    nvmlReturn_t r = node_enter("nvmlGpmMetricsGet");
    if (r) return r;
    if (!m || m->version != NVML_GPM_METRICS_GET_VERSION || m->numMetrics > NVML_GPM_METRIC_MAX)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    const stub_gpm_sample *a = m->sample1, *b = m->sample2;
    if (!valid_sample(a) || !valid_sample(b) || !a->filled || !b->filled || a->gpu != b->gpu ||
        a->gen != b->gen || b->t_s <= a->t_s)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    double dt = b->t_s - a->t_s;
    for (unsigned i = 0; i < m->numMetrics; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->value = 0.0;
        x->metricInfo.shortName = x->metricInfo.longName = x->metricInfo.unit = NULL;
        x->nvmlReturn = NVML_SUCCESS;
        if (x->metricId != NVML_GPM_METRIC_SM_UTIL) {
            x->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        double v = 100.0 * (b->sm_active_s - a->sm_active_s) / dt;
        x->value = v < 0.0 ? 0.0 : v > 100.0 ? 100.0 : v;
        x->metricInfo.shortName = "sm_util";
        x->metricInfo.longName = "SM utilization";
        x->metricInfo.unit = "%";
    }
    LEAVE(NVML_SUCCESS);
}

long nvmlStubGpmBadFrees(void) {
    pthread_mutex_lock(&mu);
    long n = gpm_bad_frees;
    pthread_mutex_unlock(&mu);
    return n;
}

long nvmlStubGpmLiveSamples(void) {
    pthread_mutex_lock(&mu);
    long n = gpm_live;
    pthread_mutex_unlock(&mu);
    return n;
}
