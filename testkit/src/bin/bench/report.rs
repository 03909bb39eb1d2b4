//! Writing results: JSON (everything) and Markdown (the tables people read),
//! under bench/results/.

use serde_json::{Value, json};
use std::path::Path;

/// A phase's hottest write key, its peak and the requests throttled.
fn hottest(phase: &Value) -> String {
    format!(
        "{} at {:.0} WCU/s, {} throttled",
        key(&phase["hottest_write_key"]),
        phase["hottest_write_units_per_s"].as_f64().unwrap_or(0.0),
        phase["throttled_requests"]
    )
}

/// A table row: its label and how a design's cell is written.
type Row<'a> = (&'a str, &'a dyn Fn(&Value) -> String);

pub fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0);
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": cpu,
        "memory_gib": (mem_kib as f64 / 1048576.0 * 10.0).round() / 10.0,
        "git_commit": commit,
    })
}

pub fn write(report: &Value, which: &str) -> anyhow::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results");
    std::fs::create_dir_all(&dir)?;
    let profile = report["profile"].as_str().unwrap_or("default");
    let stem = if which == "all" {
        profile.to_string()
    } else {
        format!("{profile}-{which}")
    };
    let json_path = dir.join(format!("{stem}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(report)? + "\n")?;
    let md_path = dir.join(format!("{stem}.md"));
    std::fs::write(&md_path, markdown(report))?;
    println!("wrote {} and {}", json_path.display(), md_path.display());
    Ok(())
}

/// A phase's write units and, of them, those billed for refused writes
/// (each lost race is one).
fn units_with_refused(phase: &Value) -> String {
    format!(
        "{:.0} / {:.0}",
        phase["write_units"].as_f64().unwrap_or(0.0),
        phase["refused_write_units"].as_f64().unwrap_or(0.0)
    )
}

fn f(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.fract() == 0.0 && x.abs() >= 10.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.2}"),
        None if v.is_null() => "–".to_string(),
        None => v.to_string(),
    }
}

/// The designs and, when it was measured, the baseline build.
const WITH_BASELINE: [&str; 4] = ["tether", "tether-baseline", "tether-0.1", "seed"];

fn markdown(r: &Value) -> String {
    let p = &r["parameters"];
    let mut md = format!(
        "# tether benchmark results ({} profile)\n\nMachine: {} CPUs ({}), {} GiB; commit {}; wall time {:.0} s.\n\
         Designs, measured in the same run: **tether** (lease {} s, heartbeat {} s, orphan scan {} s), **tether-0.1** \
         (per-stream leases: lease {} s, heartbeat {} s, orphan scan {} s) and **seed** (per-stream leases, the seed \
         design's parameters: lease {} s, heartbeat {} s, orphan scan {} s, no rebalancing).\n\n",
        r["profile"].as_str().unwrap_or(""),
        r["machine"]["cpus"],
        r["machine"]["cpu_model"].as_str().unwrap_or(""),
        r["machine"]["memory_gib"],
        r["machine"]["git_commit"].as_str().unwrap_or(""),
        r["wall_time_s"].as_f64().unwrap_or(0.0),
        f(&p["lease_s"]),
        f(&p["heartbeat_s"]),
        f(&p["reconcile_s"]),
        f(&p["v1_lease_s"]),
        f(&p["v1_heartbeat_s"]),
        f(&p["reconcile_s"]),
        f(&p["v1_lease_s"]),
        f(&p["v1_heartbeat_s"]),
        f(&p["seed_reconcile_s"]),
    );
    let res = &r["results"];
    if let Some(fo) = res.get("failover") {
        md.push_str("## Failover (signal → new session's first message)\n\n| scenario | design | p50 s | p99 s | max s | checkpoint lag p99 s | overlaps | gaps | stale |\n|---|---|---|---|---|---|---|---|---|\n");
        for scenario in ["crash_sigkill", "graceful_sigterm"] {
            for design in WITH_BASELINE
                .iter()
                .filter(|d| fo[scenario].get(**d).is_some())
            {
                let x = &fo[scenario][design];
                md.push_str(&format!(
                    "| {scenario} | {design} | {} | {} | {} | {} | {} | {} | {} |\n",
                    f(&x["p50_s"]),
                    f(&x["p99_s"]),
                    f(&x["max_s"]),
                    f(&x["checkpoint_lag_p99_s"]),
                    x["overlapping_sessions"],
                    x["sequence_gaps"],
                    x["stale_deliveries"]
                ));
            }
        }
        md.push('\n');
    }
    if let Some(c) = res.get("container_restart") {
        md.push_str(&format!(
            "## Container restart in a pod (Kubernetes API emulator; new process → first message)\n\n| | p50 s | p99 s | max s |\n|---|---|---|---|\n\
             | with the kubelet's proof | {} | {} | {} |\n| without it (lease {} s) | {} | {} | {} |\n\n",
            f(&c["with_proof"]["p50_s"]), f(&c["with_proof"]["p99_s"]), f(&c["with_proof"]["max_s"]),
            f(&c["lease_s"]),
            f(&c["without_proof"]["p50_s"]), f(&c["without_proof"]["p99_s"]), f(&c["without_proof"]["max_s"]),
        ));
    }
    if let Some(ro) = res.get("rolling_restart") {
        md.push_str("## Rolling restart of 3 workers\n\n| design | ownerless stream-seconds | max ownerless s | overlaps | gaps |\n|---|---|---|---|---|\n");
        for design in WITH_BASELINE.iter().filter(|d| ro.get(**d).is_some()) {
            let x = &ro[design];
            md.push_str(&format!(
                "| {design} | {} | {} | {} | {} |\n",
                f(&x["ownerless_stream_seconds"]),
                f(&x["max_ownerless_s"]),
                x["overlapping_sessions"],
                x["sequence_gaps"]
            ));
        }
        md.push('\n');
    }
    if let Some(j) = res.get("join").and_then(Value::as_object) {
        md.push_str("## A worker joining a balanced fleet (30 streams on 2 or 3 workers, one more starts; share 10, or 7.5 ± 1)\n\n| design, workers | newcomer at its share, s | every worker at its share, s | sessions opened | overlaps | loads at the end (newcomer / others) |\n|---|---|---|---|---|---|\n");
        for (design, x) in j {
            let or_not = |v: &Value| {
                if v.is_null() {
                    format!("not within {} s", f(&x["limit_s"]))
                } else {
                    f(v)
                }
            };
            md.push_str(&format!(
                "| {design} | {} | {} | {} | {} | {} |\n",
                or_not(&x["newcomer_at_share_s"]),
                or_not(&x["fleet_balanced_s"]),
                x["sessions_opened"],
                x["overlapping_sessions"],
                x["final_loads"].as_str().unwrap_or("-")
            ));
        }
        md.push('\n');
    }
    if let Some(c) = res.get("chaos") {
        md.push_str(&format!(
            "## Chaos soak (seed {}, {:.0} s, {} streams, {} workers, lease {} s, zero-based feed)\n\nEvents: {}. Throttled requests: {}.\n\n\
             | overlaps | gaps | stale deliveries | duplicates | max ownerless s | ownerless stream-seconds |\n|---|---|---|---|---|---|\n| {} | {} | {} | {} | {} | {} |\n\n",
            c["seed"], c["duration_s"].as_f64().unwrap_or(0.0), c["streams"], c["workers"], c["lease_s"], c["events"], c["throttled_requests"],
            c["overlapping_sessions"], c["sequence_gaps"], c["stale_deliveries"], c["duplicates"], f(&c["max_ownerless_s"]), f(&c["ownerless_stream_seconds"])
        ));
    }
    if let Some(c) = res.get("dynamodb_cost").and_then(Value::as_object) {
        let workers = c.values().find_map(|x| x["workers"].as_u64()).unwrap_or(0);
        md.push_str(&format!("## DynamoDB cost at steady state (capacity model meter; {workers} workers; 1 message/s per stream unless idle)\n\n"));
        md.push_str("| design | streams per worker | write units per stream-hour | read units per stream-hour | read units per worker-hour | hottest key WCU/s | $/month for 10,000 streams | acquires + releases in the window |\n|---|---|---|---|---|---|---|---|\n");
        for (label, x) in c.iter().filter(|(k, _)| *k != "prices") {
            let design = WITH_BASELINE
                .iter()
                .find(|d| label.starts_with(&format!("{d}_")))
                .copied()
                .unwrap_or("?");
            let idle = if label.ends_with("idle") {
                " (idle)"
            } else if label.ends_with("unpoked") {
                " (no --advertise-ip)"
            } else {
                ""
            };
            md.push_str(&format!(
                "| {design}{idle} | {} | {} | {} | {} | {} | {} | {} |\n",
                x["streams"].as_u64().unwrap_or(0) / x["workers"].as_u64().unwrap_or(1),
                f(&x["wru_per_stream_hour"]),
                f(&x["rru_per_stream_hour"]),
                f(&x["rru_per_worker_hour"]),
                f(&x["hottest_write_units_per_s"]),
                f(&x["monthly_usd_10000_streams"]),
                f(&x["ownership_changes_in_window"])
            ));
        }
        md.push_str("\nRead units per worker-hour by operation, as the workers counted them in the window:\n\n");
        for (label, x) in c.iter().filter(|(k, _)| *k != "prices") {
            if let Some(ops) = x["rru_per_worker_hour_by_operation"]
                .as_object()
                .filter(|o| !o.is_empty())
            {
                let parts: Vec<String> = ops
                    .iter()
                    .filter(|(_, v)| v.as_f64().unwrap_or(0.0) > 0.0)
                    .map(|(op, v)| format!("{op} {}", f(v)))
                    .collect();
                md.push_str(&format!("- {label}: {}\n", parts.join(", ")));
            }
        }
        md.push('\n');
    }
    if let Some(s) = res.get("scale") {
        let t = &s["tether"];
        let designs: Vec<&Value> = [&s["tether"], &s["tether_whole_reads"]]
            .into_iter()
            .filter(|d| d.is_object())
            .collect();
        md.push_str(&format!(
            "## Scale by simulation ({})\n\n{} streams on {} workers, each design on a fresh table in the same run:\n\n| | {} |\n|---|{}\n",
            t["simulation"].as_str().unwrap_or(""),
            t["streams"],
            t["workers"],
            designs.iter().map(|d| d["design"].as_str().unwrap_or("tether")).collect::<Vec<_>>().join(" | "),
            "---|".repeat(designs.len()),
        ));
        let secs = |v: &Value| v.as_f64().map_or("–".into(), |s| format!("{s:.1} s"));
        // Cores the simulation used (of the machine's): the store's, the
        // model's and the workers' shares.
        let cpu = |c: &Value| {
            let share = |name: &str| c[name].as_f64().unwrap_or(f64::NAN);
            format!(
                "{:.2} of {} (store {:.2}, model {:.2}, workers {:.2})",
                share("process_cores"),
                c["machine_cores"],
                share("store_cores"),
                share("model_cores"),
                share("worker_cores")
            )
        };
        let ms = |v: &Value| v.as_f64().map_or("–".into(), |ms| format!("{ms:.2} ms"));
        let rows: [Row; 19] = [
            (
                "streams loaded into the table before the fleet starts, in",
                &|d| secs(&d["loaded_in_s"]),
            ),
            ("all owned, from the fleet's start (cold start)", &|d| {
                secs(&d["acquire_all_s"])
            }),
            ("read units during the cold start", &|d| {
                format!(
                    "{:.0}",
                    d["acquisition"]["read_units"].as_f64().unwrap_or(0.0)
                )
            }),
            ("acquires won / lost to another worker then", &|d| {
                format!("{} / {}", d["acquires_won"], d["acquires_lost_races"])
            }),
            ("write units then, of them for refused writes", &|d| {
                units_with_refused(&d["acquisition"])
            }),
            ("cores used then", &|d| cpu(&d["acquisition_cpu"])),
            ("the workers' CPU per acquire sent then", &|d| {
                ms(&d["acquisition_worker_ms_per_acquire"])
            }),
            ("hottest key then", &|d| hottest(&d["acquisition"])),
            (
                "every worker within ±1 of its fair share, after all were owned",
                &|d| {
                    format!(
                        "{} (largest distance {})",
                        secs(&d["fair_share_within_1_after_s"]),
                        d["largest_distance_from_fair_share"]
                    )
                },
            ),
            ("steady state hottest key", &|d| {
                format!(
                    "{} at {:.1} WCU/s",
                    key(&d["steady"]["hottest_write_key"]),
                    d["steady"]["hottest_write_units_per_s"]
                        .as_f64()
                        .unwrap_or(0.0)
                )
            }),
            ("crash of 10% of the workers: streams", &|d| {
                d["crashed_streams"].to_string()
            }),
            (
                "the crashed workers declared dead after (the lease's part)",
                &|d| secs(&d["failover_declared_dead_s"]),
            ),
            ("all owned again after", &|d| {
                secs(&d["failover_all_owned_again_s"])
            }),
            ("acquires won / lost to another worker then", &|d| {
                format!(
                    "{} / {}",
                    d["failover_acquires_won"], d["failover_acquires_lost_races"]
                )
            }),
            ("write units then, of them for refused writes", &|d| {
                units_with_refused(&d["failover"])
            }),
            ("cores used then", &|d| cpu(&d["failover_cpu"])),
            ("the workers' CPU per acquire sent then", &|d| {
                ms(&d["failover_worker_ms_per_acquire"])
            }),
            ("hottest key then", &|d| hottest(&d["failover"])),
            ("double owners in the store's history", &|d| {
                d["double_owners"].to_string()
            }),
        ];
        for (label, cell) in rows {
            md.push_str(&format!(
                "| {label} | {} |\n",
                designs
                    .iter()
                    .map(|d| cell(d))
                    .collect::<Vec<_>>()
                    .join(" | ")
            ));
        }
        md.push('\n');
        md.push_str(&format!(
            "tether 0.1 through the same model, heartbeat compressed {}× (each row stands for {}× the streams at its default heartbeat):\n\n| streams | equivalent at 5 s heartbeat | hottest key | WCU/s | throttled requests |\n|---|---|---|---|---|\n",
            s["tether_0_1"]["heartbeat_compression"], s["tether_0_1"]["heartbeat_compression"]
        ));
        for row in s["tether_0_1"]["steps"].as_array().into_iter().flatten() {
            md.push_str(&format!(
                "| {} | {} | {} | {:.0} | {} |\n",
                row["streams"],
                row["equivalent_streams_at_default_heartbeat"],
                key(&row["hottest_write_key"]),
                row["hottest_write_units_per_s"].as_f64().unwrap_or(0.0),
                row["throttled_requests"]
            ));
        }
        md.push('\n');
    }
    if let Some(s) = res.get("sessions_per_worker") {
        md.push_str(&format!(
            "## Memory per session (one process; opened in one burst per step, a message every {} s each)\n\n\
             KiB of RSS growth per session, min / median / max over the runs.\n\n\
             | scheme | sessions | tether | bare tokio-tungstenite (+ tokio-rustls) | tether − bare (median) |\n|---|---|---|---|---|\n",
            f(&s["light_traffic_message_every_s"])
        ));
        for scheme in ["ws", "wss"] {
            let tether = s[scheme]["tether"].as_array().cloned().unwrap_or_default();
            let bare = s[scheme]["bare"].as_array().cloned().unwrap_or_default();
            for (t, b) in tether.iter().zip(&bare) {
                let spread = |v: &Value| {
                    format!(
                        "{} / {} / {}",
                        f(&v["kib_per_session_min"]),
                        f(&v["kib_per_session_median"]),
                        f(&v["kib_per_session_max"])
                    )
                };
                let over = t["kib_per_session_median"].as_f64().unwrap_or(0.0)
                    - b["kib_per_session_median"].as_f64().unwrap_or(0.0);
                md.push_str(&format!(
                    "| {scheme} | {} | {} | {} | {over:.1} |\n",
                    t["sessions"],
                    spread(t),
                    spread(b)
                ));
            }
        }
        md.push('\n');
    }
    if let Some(s) = res.get("sink_throughput") {
        md.push_str(&format!(
            "## Sink throughput (one worker, offered {} msg/s, {} s window)\n\n\
             | sink | msg/s acknowledged | worker CPU cores | msg per worker CPU second |\n|---|---|---|---|\n",
            s["offered_msgs_per_s"],
            f(&s["window_s"])
        ));
        for sink in ["http", "kinesis", "nats"] {
            let x = &s[sink];
            md.push_str(&format!(
                "| {sink} | {} | {} | {} |\n",
                f(&x["msgs_per_s"]),
                f(&x["worker_cpu_cores"]),
                f(&x["msgs_per_cpu_s"])
            ));
        }
        md.push('\n');
    }
    if let Some(c) = res.get("controller") {
        md.push_str(&format!(
            "## Controller load ({} resources served, Kubernetes API emulator, per minute over {} s)\n\n\
             | design | replicas | phase | API writes | status PATCHes | events | leader Lease requests | DynamoDB upserts | DynamoDB GetItem | change queries | controller RRU / WRU | controller $/month at this rate |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            c["resources"], f(&c["window_s"])
        ));
        for replicas in [1, 3] {
            for design in ["tether", "tether, polled", "tether 0.1"] {
                let x = &c[format!("{design} x{replicas}")];
                for phase in ["steady", "failover"] {
                    let p = &x[phase];
                    md.push_str(&format!(
                        "| {design} | {replicas} | {phase} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |\n",
                        f(&p["api_writes_per_min"]),
                        f(&p["status_patches_per_min"]),
                        f(&p["events_per_min"]),
                        f(&p["lease_requests_per_min"]),
                        f(&p["dynamodb_upserts_per_min"]),
                        f(&p["dynamodb_get_item_per_min"]),
                        f(&p["dynamodb_change_queries_per_min"]),
                        f(&p["dynamodb_read_units_per_min"]),
                        f(&p["dynamodb_write_units_per_min"]),
                        f(&p["dynamodb_usd_per_month"]),
                    ));
                }
            }
        }
        md.push('\n');
    }
    if let Some(st) = res.get("reconnect_storm") {
        md.push_str(&format!(
            "## Reconnect storm ({} `wss://` streams taken over at once after SIGKILL; lease {} s)\n\n\
             | | resumed after kill p50 / p99 / max s | takeover p50 / p99 / max s | taker CPU cores | max connects (TCP accepts) in 1 s | max handshakes done in 1 s | leases lost / self-fences / renewal errors |\n|---|---|---|---|---|---|---|\n",
            st["streams"], f(&st["lease_s"])
        ));
        let limit = format!(
            "limit {}/s, burst {}",
            st["limit"]["rate_per_s"], st["limit"]["burst"]
        );
        for (label, key) in [("no limit", "no_limit"), (limit.as_str(), "limited")] {
            let x = &st[key];
            md.push_str(&format!(
                "| tether, {label} | {} / {} / {} | {} / {} / {} | {} | {} | {} | {} / {} / {} |\n",
                f(&x["since_kill"]["p50_s"]),
                f(&x["since_kill"]["p99_s"]),
                f(&x["since_kill"]["max_s"]),
                f(&x["since_takeover"]["p50_s"]),
                f(&x["since_takeover"]["p99_s"]),
                f(&x["since_takeover"]["max_s"]),
                f(&x["taker_cpu_cores"]),
                x["max_connects_per_s"],
                x["max_handshakes_per_s"],
                x["leases_lost"],
                x["self_fences"],
                x["renewal_errors"],
            ));
        }
        let b = &st["bare_tokio_tungstenite_rustls"];
        md.push_str(&format!(
            "| bare tokio-tungstenite + rustls client, all at once (floor) | – | {} / {} / {} | – | – | – | – |\n\n",
            f(&b["p50_s"]), f(&b["p99_s"]), f(&b["max_s"]),
        ));
    }
    if let Some(t) = res.get("throughput") {
        let pinned = match t["measured_cpu"].as_u64() {
            Some(cpu) => format!("alone on CPU {cpu}; upstream, sink and store on the others"),
            None => "not pinned".into(),
        };
        md.push_str(&format!(
            "## Saturated throughput ({} sessions, {}-byte messages as fast as the sockets take, {} s window; measured process {pinned})\n\n\
             | scheme | client | msg/s | CPU cores | msg per CPU second | load generator CPU cores |\n|---|---|---|---|---|---|\n",
            t["sessions"], t["message_bytes"], f(&t["window_s"])
        ));
        for scheme in ["ws", "wss"] {
            let x = &t[scheme];
            for (client, label) in [
                ("tether", "tether → HTTP sink (batches ≤ 500)"),
                ("tether_json", "tether → HTTP sink, `dataFormat: json`"),
                (
                    "forwarding_floor",
                    "forwarding floor (read, batch ≤ 500, POST raw)",
                ),
                ("bare", "bare read loop (sends nothing)"),
            ] {
                let y = &x[client];
                md.push_str(&format!(
                    "| {scheme} | {label} | {} | {} | {} | {} |\n",
                    f(&y["msgs_per_s"]),
                    f(&y["cpu_cores"]),
                    f(&y["msgs_per_cpu_s"]),
                    f(&y["load_generator_cpu_cores"])
                ));
            }
            for (prefix, who) in [("", "tether"), ("json_", "tether, json data")] {
                md.push_str(&format!(
                    "| {scheme} | {who} / forwarding floor (goal ≥ 0.8 per CPU s) | {}× | | {}× | |\n\
                     | {scheme} | {who} / bare read loop | {}× | | {}× | |\n",
                    f(&x[format!("{prefix}ratio_to_floor_msgs_per_s")]),
                    f(&x[format!("{prefix}ratio_to_floor_msgs_per_cpu_s")]),
                    f(&x[format!("{prefix}ratio_msgs_per_s")]),
                    f(&x[format!("{prefix}ratio_msgs_per_cpu_s")])
                ));
            }
        }
        md.push('\n');
    }
    md
}

fn key(v: &Value) -> String {
    match (v["scope"].as_str(), v["value"].as_str()) {
        (Some(scope), Some(value)) => format!("`{scope}:{value}`"),
        _ => "-".into(),
    }
}
