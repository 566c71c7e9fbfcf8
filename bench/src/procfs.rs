//! A daemon's resources as the kernel accounts them: resident memory from
//! `/proc/<pid>/status` and `/proc/<pid>/smaps_rollup`, CPU time from
//! `/proc/<pid>/stat`. Shared by the benchmarks that report them.

/// The pid of a node daemon, or why there is none.
pub(crate) fn pid(pid: Option<u32>) -> anyhow::Result<u32> {
    pid.ok_or_else(|| anyhow::anyhow!("a daemon of the node is not running"))
}

/// Where a process's resident memory is, MiB (threads: a count).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Memory {
    /// VmRSS: every resident page mapped, shared ones counted whole.
    pub rss: f64,
    /// RssAnon: heap, stacks, anonymous mappings.
    pub anon: f64,
    /// RssFile: the binary's and libraries' pages.
    pub file: f64,
    /// Threads.
    pub threads: f64,
    /// Pss (smaps_rollup): shared pages divided among their sharers, so
    /// the processes' sums add up to the memory they use together.
    pub pss: f64,
    /// Private_Dirty (smaps_rollup): written pages of this process alone,
    /// what it frees when it exits.
    pub private_dirty: f64,
}

/// The memory of `pid`, after checking it is `name` (svc-loader runs
/// through nsenter, which execs it in place).
pub(crate) fn memory(pid: u32, name: &str) -> anyhow::Result<Memory> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))?;
    anyhow::ensure!(comm.trim() == name, "pid {pid} is {:?}, not {name}", comm.trim());
    let read = |file: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .map_err(|e| anyhow::anyhow!("reading /proc/{pid}/{file} ({name}): {e}"))
    };
    let (status, rollup) = (read("status")?, read("smaps_rollup")?);
    let value = |text: &str, file: &str, field: &str| {
        kib_field(text, field)
            .map(|v| v as f64)
            .ok_or_else(|| anyhow::anyhow!("no {field} in /proc/{pid}/{file} ({name})"))
    };
    let mib = |text: &str, file: &str, field: &str| Ok::<_, anyhow::Error>(value(text, file, field)? / 1024.0);
    Ok(Memory {
        rss: mib(&status, "status", "VmRSS")?,
        anon: mib(&status, "status", "RssAnon")?,
        file: mib(&status, "status", "RssFile")?,
        threads: value(&status, "status", "Threads")?,
        pss: mib(&rollup, "smaps_rollup", "Pss")?,
        private_dirty: mib(&rollup, "smaps_rollup", "Private_Dirty")?,
    })
}

/// VmRSS of `pid` in MiB (see [`memory`]).
pub(crate) fn rss_mib(pid: u32, name: &str) -> anyhow::Result<f64> {
    Ok(memory(pid, name)?.rss)
}

/// The value of `field` in a `/proc` key-value file (`status`,
/// `smaps_rollup`): `Name:   1234 kB`, kB dropped (a count has none). The line must name the
/// field exactly (`Pss` is not `Pss_Anon`).
fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// utime + stime of `pid` (all its threads, also exited ones), seconds.
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    anyhow::ensure!(hz > 0, "sysconf(_SC_CLK_TCK) returned {hz}");
    cpu_ticks(&stat)
        .map(|ticks| ticks as f64 / hz as f64)
        .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat has no utime and stime: {stat:?}"))
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, clock
/// ticks. The command name in parentheses may hold spaces and ')': fields
/// are counted after its last ')'.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let (_, after) = stat.rsplit_once(')')?;
    let mut fields = after.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_utime_plus_stime_after_the_command_name() {
        let stat = "4242 (svc k8s) sync) S 1 4242 4242 0 -1 4194560 900 0 0 0 123 45 0 0 20 0 7 0 100 0 0";
        assert_eq!(cpu_ticks(stat), Some(168));
        assert_eq!(cpu_ticks("4242 (x) S 1"), None);
        assert!(cpu_seconds(std::process::id()).is_ok());
    }

    /// A real `smaps_rollup` (Linux 6.1): `Pss` must not be read from the
    /// `Pss_Anon`/`Pss_File` lines after it, nor `Rss` from `Pss`.
    #[test]
    fn smaps_rollup_fields_are_read_by_exact_name() {
        let rollup = "\
55d0c7a00000-7ffd5b7f7000 ---p 00000000 00:00 0                          [rollup]
Rss:               30720 kB
Pss:               25137 kB
Pss_Dirty:         21000 kB
Pss_Anon:          20480 kB
Pss_File:           4657 kB
Pss_Shmem:             0 kB
Shared_Clean:       6144 kB
Shared_Dirty:          0 kB
Private_Clean:      3500 kB
Private_Dirty:     21076 kB
Referenced:        30720 kB
Anonymous:         20480 kB
";
        assert_eq!(kib_field(rollup, "Pss"), Some(25_137));
        assert_eq!(kib_field(rollup, "Private_Dirty"), Some(21_076));
        assert_eq!(kib_field(rollup, "Rss"), Some(30_720));
        assert_eq!(kib_field(rollup, "Swap"), None);
        assert_eq!(kib_field("VmRSS:\t  812 kB\nThreads:\t7\n", "Threads"), Some(7));
    }

    #[test]
    fn this_process_has_memory() {
        let name = std::fs::read_to_string("/proc/self/comm").unwrap();
        let m = memory(std::process::id(), name.trim()).unwrap();
        assert!(m.rss > 0.0 && m.pss > 0.0 && m.pss <= m.rss + 0.01, "{m:?}");
        assert!(m.private_dirty <= m.rss && m.threads >= 1.0, "{m:?}");
        assert!(memory(std::process::id(), "not-this-one").is_err());
    }
}
