//! stoke-sched's integration tests: inputs the simulator must refuse (`input`), and random job
//! lists and settings under which it must finish and never hand out more slots than it has
//! (`props`).

mod input;
mod policies;
mod props;
