/* The Linux thread ids of the calling thread's OpenMP team (engine.system.thread_budget reads how long
   those threads wait to run). Built with -fopenmp, so it links the libgomp torch has loaded: the team is
   the one the steps' parallel regions run on. */

#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Writes each member's id at its thread number in `ids` (`threads` entries; a member the runtime did not
   start leaves its entry as it was). Returns 0. */
int openmp_team_thread_ids(int threads, int64_t *ids) {
#pragma omp parallel num_threads(threads)
    ids[omp_get_thread_num()] = (int64_t)syscall(SYS_gettid);
    return 0;
}
