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
use std::ffi::c_void;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

type ParallelFn = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, u32, u32);

/// The OpenMP runtime's entry point, `GOMP_parallel`.
fn runtime() -> Option<ParallelFn> {
    static RUNTIME: OnceLock<Option<ParallelFn>> = OnceLock::new();
    *RUNTIME.get_or_init(|| {
        if std::env::var_os("STOKE_KERNEL_THREADS").is_some_and(|v| v == "std") {
            return None;
        }
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks a symbol up.
        let parallel = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr()) };
        // SAFETY: the symbol is libgomp's, whose C signature the type spells:
        // `void GOMP_parallel(void (*)(void *), void *, unsigned, unsigned)`.
        (!parallel.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, ParallelFn>(parallel) })
    })
}

/// Whether `run_tasks_on` runs on the OpenMP team (else on std threads).
#[cfg(test)]
pub(crate) fn on_openmp() -> bool {
    runtime().is_some()
}

/// The tasks of one `run_tasks_on`, which each thread takes from in turn.
struct Tasks<'a> {
    tasks: usize,
    task: &'a (dyn Fn(usize) + Sync),
    /// The next task not yet taken.
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Tasks<'_> {
    /// Runs tasks until none is left: whichever thread is free takes the next, so a thread that
    /// starts late or runs slow (a core shared with other work) takes fewer, and the tasks end
    /// together. A panic must not unwind into C: the first is kept and raised again by the caller.
    fn take_until_done(&self) {
        loop {
            let index = self.next.fetch_add(1, Ordering::Relaxed);
            if index >= self.tasks {
                return;
            }
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (self.task)(index))) {
                self.panic.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(panic);
            }
        }
    }
}

extern "C" fn run_share(data: *mut c_void) {
    // SAFETY: `data` is the `Tasks` that `run_tasks_on` passed, alive until `GOMP_parallel`
    // returns, which is after every thread of the team has left this function.
    let tasks = unsafe { &*(data as *const Tasks) };
    tasks.take_until_done();
}

/// Runs `task(i)` once for every `i` in `0..tasks`, on up to `threads` threads of libtorch's
/// OpenMP team (the calling thread among them), or on scoped std threads without the runtime,
/// each thread taking the next task when it is free. Returns when every task has finished; a
/// task's panic is raised again here.
pub(crate) fn run_tasks_on(tasks: usize, threads: usize, task: &(dyn Fn(usize) + Sync)) {
    let threads = threads.clamp(1, 64).min(tasks);
    if threads <= 1 {
        (0..tasks).for_each(task);
        return;
    }
    let job = Tasks { tasks, task, next: AtomicUsize::new(0), panic: Mutex::new(None) };
    match runtime() {
        // SAFETY: `run_share` only reads `job` through the pointer, and `GOMP_parallel` returns
        // after the whole team has finished with it.
        Some(parallel) => unsafe { parallel(run_share, &job as *const Tasks as *mut c_void, threads as u32, 0) },
        None => std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(|| job.take_until_done());
            }
            job.take_until_done();
        }),
    }
    if let Some(panic) = job.panic.into_inner().unwrap_or_else(|p| p.into_inner()) {
        resume_unwind(panic);
    }
}

/// `run_tasks_on` with a thread a task, returning each task's result in task order.
pub(crate) fn map_tasks<R: Send>(tasks: usize, task: impl Fn(usize) -> R + Sync) -> Vec<R> {
    map_tasks_on(tasks, tasks, task)
}

/// `run_tasks_on` that returns each task's result, in task order.
pub(crate) fn map_tasks_on<R: Send>(tasks: usize, threads: usize, task: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let slots: Vec<Mutex<Option<R>>> = (0..tasks).map(|_| Mutex::new(None)).collect();
    run_tasks_on(tasks, threads, &|i| {
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
    use super::*;

    #[test]
    fn every_task_runs_once_on_the_team() {
        // libtorch is linked into the tests, with the libgomp it loads.
        assert!(on_openmp(), "no OpenMP runtime found beside libtorch");
        for tasks in [0, 1, 2, 3, 7, 64, 100] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            for threads in [1, 2, tasks] {
                counts.iter().for_each(|c| c.store(0, Ordering::Relaxed));
                run_tasks_on(tasks, threads, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{tasks} tasks on {threads} threads");
            }
        }
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_others_finish() {
        let done = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            run_tasks_on(4, 2, &|i| {
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
