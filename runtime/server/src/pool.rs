//! The preprocessing pool: a fixed set of threads for the blocking, CPU-heavy part of a request
//! (parsing the body, rendering the chat template, tokenizing), so that the async workers only move
//! bytes and `/health` answers at once whatever other clients send.
//!
//! Invariants: at most `threads` jobs run at once; [`Pool::pending`] counts jobs queued or running
//! (the admission check adds it to the engine's queue); a job whose caller went away before it
//! started is skipped; a job that panics answers its caller with `None` and the thread lives on.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

type Task = Box<dyn FnOnce() + Send>;

pub struct Pool {
    tx: mpsc::Sender<Task>,
    pending: Arc<AtomicUsize>,
    threads: usize,
}

/// Decrements the pending count however the job ends (run, skipped or panicked).
struct Pending(Arc<AtomicUsize>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Pool {
    /// Start `threads` threads; each runs `warm` once first (so that its allocator arena and caches
    /// exist before the server measures its memory use).
    pub fn new(threads: usize, warm: Arc<dyn Fn() + Send + Sync>) -> Pool {
        let threads = threads.max(1);
        let (tx, rx) = mpsc::channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        let (ready_tx, ready_rx) = mpsc::channel();
        for i in 0..threads {
            let rx = rx.clone();
            let warm = warm.clone();
            let ready = ready_tx.clone();
            std::thread::Builder::new()
                .name(format!("metrale-prep-{i}"))
                .spawn(move || {
                    let _ = catch_unwind(AssertUnwindSafe(|| warm()));
                    let _ = ready.send(());
                    loop {
                        // The lock is held only while waiting for the next task.
                        let task = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => return,
                        };
                        match task {
                            Ok(t) => t(),
                            Err(_) => return, // the pool was dropped
                        }
                    }
                })
                .expect("spawning a preprocessing thread");
        }
        for _ in 0..threads {
            let _ = ready_rx.recv();
        }
        Pool {
            tx,
            pending: Arc::new(AtomicUsize::new(0)),
            threads,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// Run `f` on a pool thread; `None` if it panicked.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let guard = Pending(self.pending.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task: Task = Box::new(move || {
            if tx.is_closed() {
                return; // the client went away while the job was queued
            }
            let out = catch_unwind(AssertUnwindSafe(f));
            drop(guard); // no longer pending once the caller can see the result
            if let Ok(v) = out {
                let _ = tx.send(v);
            }
        });
        self.tx.send(task).ok()?;
        rx.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_bounds_and_survives_panics() {
        let pool = Pool::new(2, Arc::new(|| {}));
        assert_eq!(pool.run(|| 6 * 7).await, Some(42));
        assert_eq!(pool.run(|| -> i32 { panic!("boom") }).await, None);
        // Both threads still serve after a panic.
        let a = pool.run(|| 1);
        let b = pool.run(|| 2);
        assert_eq!((a.await, b.await), (Some(1), Some(2)));
        assert_eq!(pool.pending(), 0);
        // At most `threads` jobs run at once: 4 jobs of 100 ms on 2 threads take >= 200 ms.
        let t = std::time::Instant::now();
        let jobs: Vec<_> = (0..4)
            .map(|_| pool.run(|| std::thread::sleep(std::time::Duration::from_millis(100))))
            .collect();
        futures::future::join_all(jobs).await;
        assert!(t.elapsed().as_millis() >= 200);
    }
}
