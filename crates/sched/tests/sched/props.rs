//! Random job lists and settings: every simulation ends, every job completes, no interval hands
//! out more slots than the cluster has, and no job runs outside its limits.

use proptest::prelude::*;
use stoke_sched::{simulate, Efficiency, JobSpec, Policy, Scaling, SimConfig};

fn scaling() -> impl Strategy<Value = Scaling> {
    prop_oneof![
        (0.1f64..1000.0, 0.0f64..=1.0).prop_map(|(t1, p)| Scaling::Amdahl { t1, p }),
        prop::collection::btree_map(1usize..=16, 0.1f64..1000.0, 1..5)
            .prop_map(|points| Scaling::Points(points.into_iter().collect())),
    ]
}

fn job(index: usize) -> impl Strategy<Value = JobSpec> {
    (0.0f64..2000.0, 1.0f64..1e5, 1usize..=4, 0usize..=12, scaling(), 0.0f64..120.0, 0.1f64..10.0, 0.0f64..1000.0)
        .prop_map(move |(submit_s, work, min, extra, scaling, resize_s, priority, noise)| JobSpec {
            name: format!("j{index}"),
            submit_s,
            work,
            min_workers: min,
            max_workers: min + extra,
            scaling,
            efficiency: if noise > 500.0 {
                Efficiency::FIXED_BATCH
            } else {
                Efficiency { b0: 32.0, batch_grows: true, noise }
            },
            resize_s,
            start_s: 0.0,
            priority,
            batch: None,
            asked_workers: None,
        })
}

fn jobs() -> impl Strategy<Value = Vec<JobSpec>> {
    (1usize..=10).prop_flat_map(|n| (0..n).map(job).collect::<Vec<_>>())
}

fn policy() -> impl Strategy<Value = Policy> {
    prop::sample::select(Policy::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_simulation_ends_and_conserves_slots(
        jobs in jobs(),
        slots in 4usize..=24,
        policy in policy(),
        tick_s in 1.0f64..600.0,
        interval in 0.0f64..600.0,
    ) {
        let config = SimConfig { tick_s, min_resize_interval_s: interval, max_events: 200_000, ..SimConfig::new(slots, policy) };
        let result = simulate(&jobs, &config).unwrap();
        for segment in &result.timeline {
            let held: usize = segment.held.iter().map(|h| h.1).sum();
            prop_assert!(held <= slots, "{held} of {slots} slots at {}", segment.start_s);
            for &(j, w) in &segment.held {
                prop_assert!(w >= jobs[j].min_workers && w <= jobs[j].max_workers, "{} on {w}", jobs[j].name);
            }
        }
        for (spec, r) in jobs.iter().zip(&result.jobs) {
            prop_assert!(r.finish_s.is_finite() && r.finish_s >= spec.submit_s, "{r:?}");
            prop_assert!(r.start_s >= spec.submit_s, "{r:?}");
        }
    }
}
