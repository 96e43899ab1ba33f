//! Every input that once made the simulator loop for ever, or that it accepted against sense, is
//! refused with an error naming the line or flag, the field and the allowed range.

use stoke_sched::{parse_csv, simulate, Efficiency, JobSpec, Policy, Scaling, SimConfig};

const HEADER: &str =
    "submit_s,name,work,min_workers,max_workers,scaling,resize_s,priority,noise_scale,batch_per_worker\n";

/// Parses `HEADER` + `line` and expects an error on line 2 that mentions every one of `words`.
fn check_csv(line: &str, words: &[&str]) {
    let err = parse_csv(&format!("{HEADER}{line}\n")).expect_err(line).to_string();
    assert!(err.contains("line 2"), "{line}: {err}");
    for word in words {
        assert!(err.contains(word), "{line}: `{word}` not in `{err}`");
    }
}

#[test]
fn bad_fields_are_refused_naming_line_field_and_range() {
    // Efficiency 2.0 and a loop for ever, before.
    check_csv("0,a,100,1,4,linear:10,30,1,100,-50", &["batch_per_worker", "-50", "1 <= batch_per_worker"]);
    check_csv("0,a,100,1,4,linear:10,30,1,-1,8", &["noise_scale", "0 <= noise_scale"]);
    check_csv("0,a,100,1,4,points:1=inf", &["scaling", "throughput"]);
    check_csv("0,a,100,1,4,points:1=nan", &["scaling"]);
    check_csv("0,a,100,1,4,linear:10,-5", &["resize_s", "-5", "0 <= resize_s"]);
    check_csv("0,a,100,1,4,linear:10,30,0", &["priority", "0 < priority"]);
    check_csv("0,a,100,1,4,linear:10,30,-1", &["priority", "-1"]);
    check_csv("0,a,100,1,4,linear:10,30,nan", &["priority", "nan"]);
    check_csv("0,a,1e300,1,4,linear:10", &["work", "1e300", "work <= 1e15"]);
    check_csv("-1,a,100,1,4,linear:10", &["submit_s", "0 <= submit_s"]);
    check_csv("0,a,100,0,4,linear:10", &["min_workers", "1 <= min_workers"]);
    check_csv("0,a,100,3,2,linear:10", &["min_workers 3 > max_workers 2"]);
    check_csv("0,a,100,1,4,amdahl:10:1.5", &["scaling", "0 <= P <= 1"]);
    let err = parse_csv(&format!("{HEADER}0,a,100,1,4,linear:10\n\n5,a,100,1,4,linear:10\n")).unwrap_err().to_string();
    assert!(err.contains("line 4") && err.contains("`a`") && err.contains("line 2"), "{err}");
    let err = parse_csv("submit_s,name,work,min_workers,max_workers,scalling\n").unwrap_err().to_string();
    assert!(err.contains("line 1") && err.contains("scalling"), "{err}");
}

fn job(work: f64) -> JobSpec {
    JobSpec {
        name: "a".into(),
        submit_s: 0.0,
        work,
        min_workers: 1,
        max_workers: 2,
        scaling: Scaling::Amdahl { t1: 1.0, p: 0.9 },
        efficiency: Efficiency::FIXED_BATCH,
        resize_s: 10.0,
        start_s: 0.0,
        priority: 1.0,
        batch: None,
        asked_workers: None,
    }
}

#[test]
fn flags_that_stop_the_clock_are_refused() {
    for tick in [0.0, -60.0, 5e-324, f64::NAN, f64::INFINITY] {
        let config = SimConfig { tick_s: tick, ..SimConfig::new(4, Policy::Goodput) };
        let err = simulate(&[job(100.0)], &config).unwrap_err().to_string();
        assert!(err.contains("--tick-s") && err.contains("<= tick_s"), "{tick}: {err}");
    }
    for interval in [-1.0, f64::NAN] {
        let config = SimConfig { min_resize_interval_s: interval, ..SimConfig::new(4, Policy::Goodput) };
        let err = simulate(&[job(100.0)], &config).unwrap_err().to_string();
        assert!(err.contains("--min-resize-interval-s"), "{interval}: {err}");
    }
    let err = simulate(&[job(100.0)], &SimConfig::new(0, Policy::Fair)).unwrap_err().to_string();
    assert!(err.contains("--slots"), "{err}");
}

#[test]
fn jobs_built_in_code_are_checked_as_the_csv_is() {
    let config = SimConfig::new(4, Policy::Goodput);
    let cases: Vec<(JobSpec, &str)> = vec![
        (JobSpec { resize_s: -5.0, ..job(100.0) }, "resize_s"),
        (JobSpec { priority: 0.0, ..job(100.0) }, "priority"),
        (JobSpec { priority: f64::NAN, ..job(100.0) }, "priority"),
        (JobSpec { work: 1e300, ..job(100.0) }, "work"),
        (JobSpec { scaling: Scaling::Points(vec![(1, f64::INFINITY)]), ..job(100.0) }, "throughput"),
        (
            JobSpec { efficiency: Efficiency { b0: -50.0, batch_grows: true, noise: 100.0 }, ..job(100.0) },
            "batch_per_worker",
        ),
        (JobSpec { min_workers: 8, max_workers: 8, ..job(100.0) }, "more than the 4 slots"),
    ];
    for (spec, word) in cases {
        let err = simulate(std::slice::from_ref(&spec), &config).unwrap_err().to_string();
        assert!(err.contains("job a") && err.contains(word), "{spec:?}: {err}");
    }
    let twice = simulate(&[job(100.0), job(50.0)], &config).unwrap_err().to_string();
    assert!(twice.contains("two jobs have this name"), "{twice}");
}

#[test]
fn a_job_too_long_for_the_clock_stops_with_an_error_not_a_loop() {
    // 1e15 samples at 1e-6 samples/s: past the horizon, said so (not "never allocated").
    let slow = JobSpec { scaling: Scaling::Points(vec![(1, 1e-6)]), work: 1e15, ..job(0.0) };
    let err = simulate(&[slow], &SimConfig::new(4, Policy::Fair)).unwrap_err().to_string();
    assert!(err.contains("horizon") && err.contains("job a"), "{err}");
    // A tick far shorter than the job: bounded by the event budget.
    let config = SimConfig { tick_s: 1e-3, max_events: 1000, ..SimConfig::new(4, Policy::Goodput) };
    let err = simulate(&[job(1e6)], &config).unwrap_err().to_string();
    assert!(err.contains("1000 events") && err.contains("--tick-s"), "{err}");
}

#[test]
fn per_job_results_carry_every_allocation() {
    let jobs = [job(1000.0), JobSpec { name: "b".into(), submit_s: 50.0, ..job(100.0) }];
    let r = simulate(&jobs, &SimConfig::new(2, Policy::Fair)).unwrap();
    let a = &r.jobs[0];
    assert_eq!(a.allocations.first().map(|x| x.1), Some(2));
    assert_eq!(a.allocations.last(), Some(&(a.finish_s, 0)));
    assert!(a.allocations.iter().any(|&(t, w)| t == 50.0 && w == 1), "{:?}", a.allocations);
}
