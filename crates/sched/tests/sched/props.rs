//! Random job lists and settings: every simulation ends, every job completes, no interval hands
//! out more slots than the cluster has, and no job runs outside its limits.

use proptest::prelude::*;
use stoke_sched::{simulate, BatchModel, Efficiency, JobSpec, Policy, Scaling, SimConfig, StepTable};

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

/// A job whose batch the goodput policy chooses: a step table on 1, 2, 4 and 8 workers, a noise
/// schedule of two steps.
fn adaptive(index: usize) -> impl Strategy<Value = JobSpec> {
    (job(index), 0.01f64..0.5, 0.0f64..0.9, 1.0f64..5000.0, 1.0f64..5000.0, 1u32..4).prop_map(
        |(base, step_s, sync_share, noise_a, noise_b, range)| {
            let mut rows: Vec<String> = [1usize, 2, 4, 8]
                .iter()
                .flat_map(|&w| {
                    [16.0, 64.0].map(move |m: f64| {
                        let step = step_s * (1.0 + m / 64.0) * (1.0 + 0.1 * w as f64);
                        format!("{w}x{m}={step}/{}", step * sync_share * (w > 1) as u8 as f64)
                    })
                })
                .collect();
            rows.push(format!("2x16@2={}/{}", 2.0 * step_s, step_s));
            rows.push(format!("4x64@3={}/{}", 3.0 * step_s, 2.0 * step_s));
            let model = BatchModel {
                table: StepTable::parse(&rows.join(";")).unwrap(),
                batch: 32.0,
                batch_min: 16.0,
                batch_max: 16.0 * 4f64.powi(range as i32),
                b0: 16.0,
                micro_max: 64.0,
                noise: vec![(0.0, noise_a), (0.4, noise_b)],
                noise_by_batch: if range > 2 {
                    vec![(16.0, vec![(0.0, noise_a), (0.3, noise_b)]), (64.0, vec![(0.0, noise_b), (0.6, noise_a)])]
                } else {
                    Vec::new()
                },
            };
            JobSpec { batch: Some(model), ..base }
        },
    )
}

fn jobs() -> impl Strategy<Value = Vec<JobSpec>> {
    (1usize..=10).prop_flat_map(|n| (0..n).map(|i| prop_oneof![job(i), adaptive(i)].boxed()).collect::<Vec<_>>())
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
        on_ticks_only in any::<bool>(),
        fairness_p in -2.0f64..=1.0,
        per_node in prop::option::of(1usize..=8),
    ) {
        let config = SimConfig {
            tick_s,
            min_resize_interval_s: interval,
            max_events: 200_000,
            on_ticks_only,
            fairness_p,
            slots_per_node: per_node.map(|p| p.min(slots)),
            ..SimConfig::new(slots, policy)
        };
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The job CSV comes from users: any mutation or truncation of a valid list parses or is
    /// refused with an error, never a panic; what parses simulates to an end or an error.
    #[test]
    fn fuzz_mutated_job_csv(
        jobs in jobs(),
        cuts in proptest::collection::vec((0usize..4000, any::<u8>()), 1..6),
        truncate in proptest::option::of(0usize..4000),
    ) {
        let mut bytes = stoke_sched::to_csv(&jobs).into_bytes();
        for (at, byte) in &cuts {
            let i = at % bytes.len();
            bytes[i] = *byte;
        }
        if let Some(len) = truncate {
            bytes.truncate(len % (bytes.len() + 1));
        }
        if let Ok(parsed) = stoke_sched::parse_csv(&String::from_utf8_lossy(&bytes)) {
            let config = SimConfig { max_events: 50_000, ..SimConfig::new(8, Policy::Goodput) };
            let _ = simulate(&parsed, &config);
        }
    }
}
