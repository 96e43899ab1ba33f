//! The binary's side of `stoke plan` (the model is `stoke_plan`): the ranked layouts of a search
//! (`search`), the calibration of this machine's efficiencies on measured runs (`calibration`),
//! and the ZeRO table of model states per rank (`zero_table`), each printed as text or JSON in
//! one write (`output`); `best` turns the first runnable layout into `stoke launch --plan best`'s
//! settings.

mod best;
mod calibration;
mod output;
mod search;
mod zero_table;

pub use best::best_layout;
pub use calibration::{read_efficiency, run_calibration, Calibration};
pub use search::print_search;
pub use zero_table::{run_zero_table, ZeroTable};
