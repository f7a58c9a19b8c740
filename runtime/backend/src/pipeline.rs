//! An ordered producer pipeline: items made on a few threads, consumed in order on the calling one,
//! with a bound on how many are held at once. The CUDA backend reads and repacks a checkpoint's
//! tensors this way while it uploads them (`cuda::weights`).
//!
//! Invariants: `consume` sees items in index order, each once; at most `window` items are made
//! ahead of the one being consumed; the first error (or a panic in `make`, turned into an error)
//! stops the work; every thread has ended when [`ordered`] returns.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard};

use metrale_core::BackendError;

struct State<T> {
    /// the next index a worker may take
    next: usize,
    /// items handed to `consume` so far
    consumed: usize,
    /// made, not yet consumed
    done: BTreeMap<usize, Result<T, BackendError>>,
    stop: bool,
}

fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, State<T>>) -> MutexGuard<'a, State<T>> {
    cv.wait(g).unwrap_or_else(|p| p.into_inner())
}

/// Make items `0..n` with `make` on up to `workers` threads and hand them to `consume` in order on
/// this thread, never more than `window` (at least 1) items made ahead of the one being consumed.
/// Returns the first error of either side.
pub fn ordered<T: Send>(
    n: usize,
    workers: usize,
    window: usize,
    make: &(dyn Fn(usize) -> Result<T, BackendError> + Sync),
    consume: &mut dyn FnMut(usize, T) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    let window = window.max(1);
    let st = Mutex::new(State {
        next: 0,
        consumed: 0,
        done: BTreeMap::new(),
        stop: false,
    });
    let cv = Condvar::new();
    let lock = || st.lock().unwrap_or_else(|p| p.into_inner());
    std::thread::scope(|s| {
        for _ in 0..workers.clamp(1, n.max(1)) {
            s.spawn(|| loop {
                let i = {
                    let mut g = lock();
                    loop {
                        if g.stop || g.next >= n {
                            return;
                        }
                        if g.next < g.consumed + window {
                            break;
                        }
                        g = wait(&cv, g);
                    }
                    g.next += 1;
                    g.next - 1
                };
                let r = catch_unwind(AssertUnwindSafe(|| make(i))).unwrap_or_else(|_| {
                    Err(BackendError::Invalid(format!(
                        "preparing item {i} panicked (a bug: please report it)"
                    )))
                });
                lock().done.insert(i, r);
                cv.notify_all();
            });
        }
        let mut result = Ok(());
        for i in 0..n {
            let item = {
                let mut g = lock();
                loop {
                    if let Some(r) = g.done.remove(&i) {
                        break r;
                    }
                    g = wait(&cv, g);
                }
            };
            let r = item.and_then(|t| consume(i, t));
            lock().consumed = i + 1;
            cv.notify_all();
            if r.is_err() {
                result = r;
                break;
            }
        }
        lock().stop = true;
        cv.notify_all();
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn items_arrive_in_order_and_never_more_than_the_window_ahead() {
        for (workers, window) in [(1, 1), (4, 1), (4, 3), (8, 8), (3, 20)] {
            let held = AtomicUsize::new(0);
            let most = AtomicUsize::new(0);
            let make = |i: usize| {
                // uneven work so items finish out of order
                std::thread::sleep(Duration::from_micros(((i * 7919) % 13) as u64 * 100));
                let h = held.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(h, Ordering::SeqCst);
                Ok(i * 10)
            };
            let mut seen = Vec::new();
            ordered(40, workers, window, &make, &mut |i, v| {
                assert_eq!(v, i * 10);
                seen.push(i);
                held.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, (0..40).collect::<Vec<_>>());
            let most = most.load(Ordering::SeqCst);
            assert!(
                most <= window + 1,
                "{most} items held at once with a window of {window}"
            );
        }
    }

    #[test]
    fn the_first_error_stops_the_work_from_either_side() {
        let made = AtomicUsize::new(0);
        let make = |i: usize| {
            made.fetch_add(1, Ordering::SeqCst);
            if i == 5 {
                Err(BackendError::Model("tensor 5 is short".into()))
            } else {
                Ok(i)
            }
        };
        let mut seen = Vec::new();
        let e = ordered(100, 4, 2, &make, &mut |i, _| {
            seen.push(i);
            Ok(())
        })
        .unwrap_err();
        assert!(e.to_string().contains("tensor 5 is short"), "{e}");
        assert_eq!(seen, (0..5).collect::<Vec<_>>());
        assert!(
            made.load(Ordering::SeqCst) <= 8,
            "work went on after the error"
        );

        let e = ordered(100, 4, 2, &|i| Ok(i), &mut |i, _| {
            if i == 3 {
                Err(BackendError::Device("out of memory".into()))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert!(e.to_string().contains("out of memory"), "{e}");
    }

    #[test]
    fn a_panic_while_making_is_an_error_not_a_hang() {
        let e = ordered(
            10,
            3,
            2,
            &|i| if i == 2 { panic!("bug") } else { Ok(i) },
            &mut |_, _| Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("item 2 panicked"), "{e}");
    }

    #[test]
    fn nothing_to_make_is_fine() {
        ordered::<u8>(0, 4, 4, &|_| unreachable!(), &mut |_, _| unreachable!()).unwrap();
    }
}
