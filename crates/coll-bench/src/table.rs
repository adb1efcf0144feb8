//! Text tables of the commands that need no MPI (`compare`, `traffic-table`): the same rows as
//! Markdown or as right-aligned plain text.

fn strs<S: AsRef<str>>(cells: &[S]) -> Vec<&str> {
    cells.iter().map(AsRef::as_ref).collect()
}

/// A Markdown table: the header, the `|---|` line and one line per row, each ending in `\n`.
pub fn markdown<H: AsRef<str>, C: AsRef<str>>(header: &[H], lines: &[Vec<C>]) -> String {
    let mut out = format!("| {} |\n", strs(header).join(" | "));
    out += &format!(
        "|{}|\n",
        header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
    );
    for l in lines {
        out += &format!("| {} |\n", strs(l).join(" | "));
    }
    out
}

/// A plain-text table: every column right-aligned to its widest cell, cells separated by one
/// space, the header first; each line ends in `\n`.
pub fn aligned<H: AsRef<str>, C: AsRef<str>>(header: &[H], lines: &[Vec<C>]) -> String {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].as_ref().len())
                .chain([header[i].as_ref().len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let row = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut out = String::new();
    for cells in [strs(header)]
        .into_iter()
        .chain(lines.iter().map(|l| strs(l)))
    {
        out += &row(cells);
        out.push('\n');
    }
    out
}
