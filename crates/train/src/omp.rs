//! Runs the Rust kernels' parallel work on libtorch's own OpenMP threads.
//!
//! libtorch's CPU ops run on an OpenMP team, and after each op its worker threads spin for a while
//! waiting for the next one (libgomp's default wait policy). A Rust kernel that spawned threads of
//! its own between two libtorch ops put them on cores where those workers were still spinning: on
//! the 2-core machine a tiny bf16 step with the first causal softmax kernel on std threads spent
//! 18.6% of its CPU samples in libgomp against 12.2% without it, and with the fused LayerNorm on,
//! the step on the team took 0.859 of its time on std threads (README, "The Rust kernels on
//! libtorch's threads"). Here the work is handed to the same team through the OpenMP
//! runtime's entry point (`GOMP_parallel`, found at run time in the libgomp that libtorch loaded),
//! so a spinning worker takes it at once. Without that runtime (a libtorch built with another
//! OpenMP, or none) the work runs on scoped std threads as before.

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

type ParallelFn = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, u32, u32);
type IntFn = unsafe extern "C" fn() -> i32;

/// The OpenMP runtime's entry points.
struct Runtime {
    parallel: ParallelFn,
    thread_num: IntFn,
    num_threads: IntFn,
}

fn runtime() -> Option<&'static Runtime> {
    static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            if std::env::var_os("STOKE_KERNEL_THREADS").is_some_and(|v| v == "std") {
                return None;
            }
            let find = |name: &CStr| {
                // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks a symbol up.
                unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
            };
            let (parallel, thread_num, num_threads) =
                (find(c"GOMP_parallel"), find(c"omp_get_thread_num"), find(c"omp_get_num_threads"));
            if parallel.is_null() || thread_num.is_null() || num_threads.is_null() {
                return None;
            }
            // SAFETY: the symbols are libgomp's, whose C signatures these types spell:
            // `void GOMP_parallel(void (*)(void *), void *, unsigned, unsigned)` and
            // `int omp_get_thread_num(void)`, `int omp_get_num_threads(void)`.
            unsafe {
                Some(Runtime {
                    parallel: std::mem::transmute::<*mut c_void, ParallelFn>(parallel),
                    thread_num: std::mem::transmute::<*mut c_void, IntFn>(thread_num),
                    num_threads: std::mem::transmute::<*mut c_void, IntFn>(num_threads),
                })
            }
        })
        .as_ref()
}

/// Whether `run_tasks` runs on the OpenMP team (else on std threads).
#[cfg(test)]
pub(crate) fn on_openmp() -> bool {
    runtime().is_some()
}

/// What each thread of the team reads.
struct Job<'a> {
    runtime: &'static Runtime,
    tasks: usize,
    task: &'a (dyn Fn(usize) + Sync),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

extern "C" fn run_share(data: *mut c_void) {
    // SAFETY: `data` is the `Job` that `run_tasks` passed, alive until `GOMP_parallel` returns,
    // which is after every thread of the team has left this function.
    let job = unsafe { &*(data as *const Job) };
    // SAFETY: called inside the parallel region, as OpenMP allows.
    let (me, team) =
        unsafe { ((job.runtime.thread_num)().max(0) as usize, (job.runtime.num_threads)().max(1) as usize) };
    // A panic must not unwind into C: the first is kept and raised again by the caller.
    for index in (me..job.tasks).step_by(team) {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (job.task)(index))) {
            job.panic.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(panic);
        }
    }
}

/// Runs `task(i)` once for every `i` in `0..tasks`, on up to `tasks` threads of libtorch's OpenMP
/// team (the calling thread among them; a smaller team takes the tasks in turn), or on scoped std
/// threads without the runtime. Returns when every task has finished; a task's panic is raised
/// again here.
pub(crate) fn run_tasks(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    if tasks <= 1 {
        (0..tasks).for_each(task);
        return;
    }
    let Some(runtime) = runtime() else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (1..tasks).map(|i| scope.spawn(move || task(i))).collect();
            task(0);
            for handle in handles {
                if let Err(panic) = handle.join() {
                    resume_unwind(panic);
                }
            }
        });
        return;
    };
    let job = Job { runtime, tasks, task, panic: Mutex::new(None) };
    // SAFETY: `run_share` only reads `job` through the pointer, and `GOMP_parallel` returns after
    // the whole team has finished with it.
    unsafe { (runtime.parallel)(run_share, &job as *const Job as *mut c_void, tasks.min(64) as u32, 0) };
    if let Some(panic) = job.panic.into_inner().unwrap_or_else(|p| p.into_inner()) {
        resume_unwind(panic);
    }
}

/// `run_tasks` that returns each task's result, in task order.
pub(crate) fn map_tasks<R: Send>(tasks: usize, task: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let slots: Vec<Mutex<Option<R>>> = (0..tasks).map(|_| Mutex::new(None)).collect();
    run_tasks(tasks, &|i| {
        let result = task(i);
        *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
    });
    slots
        .into_iter()
        .map(|slot| slot.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every task ran"))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn every_task_runs_once_on_the_team() {
        // libtorch is linked into the tests, with the libgomp it loads.
        assert!(on_openmp(), "no OpenMP runtime found beside libtorch");
        for tasks in [0, 1, 2, 3, 7, 64, 100] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            run_tasks(tasks, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_others_finish() {
        let done = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            run_tasks(4, &|i| {
                if i == 2 {
                    panic!("task 2 fails");
                }
                done.fetch_add(1, Ordering::Relaxed);
            })
        }));
        let message = result.expect_err("the panic reaches the caller");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"task 2 fails"));
        assert_eq!(done.load(Ordering::Relaxed), 3);
    }
}
