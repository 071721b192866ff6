//! The process-wide runtime that runs persists and restores, and the priority of its threads.

use std::sync::OnceLock;

/// The process-wide runtime that runs persists and restores.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(32)
            .thread_name("ckpt-io")
            .on_thread_start(lower_io_priority)
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// The nice value of the persist threads; see [`set_io_nice`].
static IO_NICE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(10);

/// Persisting runs at a lower CPU priority (nice 10 by default) than training: where the
/// training loop itself runs on the CPU, a background persist then slows its steps little and
/// takes the cores the loop leaves idle. (The snapshot copy threads keep normal priority: the
/// loop may be waiting for them.) Set before the first save: the persist threads take it when
/// they start (`ckpt-train --io-nice`, `CKPT_IO_NICE`).
pub fn set_io_nice(nice: i32) {
    IO_NICE.store(nice, std::sync::atomic::Ordering::Relaxed);
}

fn lower_io_priority() {
    let nice = IO_NICE.load(std::sync::atomic::Ordering::Relaxed);
    if nice != 0 {
        // SAFETY: plain libc calls on the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice);
        }
    }
}
