//! `coll-bench traffic-table`: `traffic --json` files as one table.

use crate::compare::read_rows;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TrafficTableArgs {
    /// JSON Lines files written by `coll-bench traffic --json`, rendered in order.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,

    /// Print a Markdown table instead of plain text.
    #[arg(long)]
    markdown: bool,
}

pub fn traffic_table(args: TrafficTableArgs) -> i32 {
    let mut rows = Vec::new();
    for f in &args.files {
        match read_rows(f) {
            Ok(r) => rows.extend(r),
            Err(e) => {
                eprintln!("coll-bench traffic-table: {e}");
                return 2;
            }
        }
    }
    let (text, ok) = coll_bench::traffic::render_table(&rows, args.markdown);
    print!("{text}");
    if !ok {
        eprintln!("coll-bench traffic-table: some rows did not validate");
        return 1;
    }
    0
}
