//! The goodput policy's promises: a job alone gets every slot that speeds it up, past a dip in
//! its throughput curve; slots a finished job frees go to whoever gains at that event; the batch
//! is chosen with the workers; and every policy runs the same job list.

use stoke_sched::{parse_csv, simulate, BatchChoice, JobSpec, Policy, SimConfig};

const HEADER: &str = "submit_s,name,work,min_workers,max_workers,scaling,resize_s,priority,noise_scale,batch_per_worker,batch,batch_range,micro_max,step_table,noise_schedule,b0,workers\n";

fn jobs(rows: &str) -> Vec<JobSpec> {
    parse_csv(&format!("{HEADER}{rows}")).unwrap()
}

#[test]
fn a_job_alone_gets_every_slot_that_speeds_it_up_even_past_a_dip() {
    // 4 workers: 400/s; 5: 300/s (a second node); 8: 700/s; 16: 1200/s.
    let list = jobs("0,dip,1e6,1,16,points:1=100;4=400;5=300;8=700;16=1200,30\n");
    let r = simulate(&list, &SimConfig::new(16, Policy::Goodput)).unwrap();
    assert_eq!(r.jobs[0].allocations.first().map(|a| a.1), Some(16), "{:?}", r.jobs[0].allocations);
    assert!((r.utilization() - 1.0).abs() < 1e-9);
}

#[test]
fn slots_a_finished_job_frees_go_at_once_to_the_job_they_speed_up() {
    // Two identical jobs on 4 slots: 2 each, then the survivor takes all 4 when the other ends.
    let list = jobs("0,a,1e5,1,4,linear:100,30\n0,b,2e5,1,4,linear:100,30\n");
    let r = simulate(&list, &SimConfig::new(4, Policy::Goodput)).unwrap();
    let a_end = r.jobs[0].finish_s;
    let grown = r.jobs[1].allocations.iter().find(|x| x.1 == 4).expect("b grows to 4");
    assert_eq!(grown.0, a_end, "{:?}", r.jobs[1].allocations);
    assert!(r.utilization() > 0.97, "{}", r.utilization());
}

#[test]
fn the_batch_grows_with_the_workers_and_the_noise_scale() {
    let list = jobs(
        "0,adaptive,1e6,1,8,,30,1,,,64,32-1024,64,1x32=0.1/0;1x64=0.15/0;8x32=0.14/0.04;8x64=0.19/0.04,0=200;0.5=2000\n",
    );
    let job = &list[0];
    let model = job.batch.as_ref().unwrap();
    assert!(model.best(8, 0.0).1 > model.best(1, 0.0).1);
    assert!(model.best(8, 0.9).1 > model.best(8, 0.0).1);
    assert!(job.goodput_at(8, 0.0, BatchChoice::Best) >= job.goodput_at(8, 0.0, BatchChoice::Asked));
    let mut means = Vec::new();
    for &policy in Policy::ALL {
        let r = simulate(&list, &SimConfig::new(8, policy)).unwrap();
        means.push((policy, r.mean_completion_s()));
    }
    let fair = means.iter().find(|m| m.0 == Policy::Fair).unwrap().1;
    let good = means.iter().find(|m| m.0 == Policy::Goodput).unwrap().1;
    assert!(good < fair, "{means:?}");
}

#[test]
fn a_spread_placement_runs_at_the_spread_speed() {
    // 3 slots a node: a and c (2 workers each) take one node each, so b (2) straddles both.
    let list = jobs(
        "0,a,1e4,2,2,linear:10,0\n0,c,1e4,2,2,linear:10,0\n\
         0,b,1e3,2,2,,0,1,,,32,32-32,16,2x16=0.1/0.01;2x16@2=0.4/0.3,0=100\n",
    );
    let packed = simulate(&list, &SimConfig::new(6, Policy::Fifo)).unwrap();
    let nodes = simulate(&list, &SimConfig { slots_per_node: Some(3), ..SimConfig::new(6, Policy::Fifo) }).unwrap();
    let ratio = nodes.jobs[2].completion_s() / packed.jobs[2].completion_s();
    assert!((ratio - 4.0).abs() < 1e-9, "{ratio}: {:?} {:?}", nodes.jobs[2], packed.jobs[2]);
    assert_eq!(nodes.jobs[0].completion_s(), packed.jobs[0].completion_s());
}
