//! Engine `etcd` of the torture (feature `etcd`): a private 3-member etcd cluster from Debian's
//! `/usr/bin/etcd`, data on tmpfs (`/dev/shm`) when there is one, fast elections (50 ms
//! heartbeat, 500 ms election timeout), as `tests/common/etcd.rs` starts it.
//!
//! Faults (besides the coordinator's worker kill / stop): kill a follower or the leader and
//! restart it after 1.5–3 s, SIGSTOP the leader or a follower for 1.5–3 s, kill two members
//! (the majority: no quorum) and restart them after 1.5–3 s.

use std::io::{Read as _, Write as _};

use super::*;

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// The cluster; members killed and their tmpfs dirs removed on drop.
pub(crate) struct EtcdSet {
    members: Vec<Member>,
    initial_cluster: String,
}

/// `GET /health`: true when the member reports healthy (it has a leader).
fn healthy(port: u16) -> bool {
    http(port, "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_some_and(|out| out.contains("\"health\":\"true\""))
}

fn http(port: u16, req: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().ok()?,
        Duration::from_millis(300),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    Some(out)
}

impl Member {
    fn spawn(&mut self, initial_cluster: &str, state: &str) -> io::Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))?;
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new("/usr/bin/etcd");
        cmd.args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "dlock-torture"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .env("ETCD_UNSUPPORTED_ARCH", "")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.child = Some(
            spawn_tied(&mut cmd)
                .map_err(|e| io::Error::new(e.kind(), format!("cannot run /usr/bin/etcd: {e}")))?,
        );
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), libc::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl EtcdSet {
    pub(crate) fn start(dir: &Path) -> io::Result<EtcdSet> {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm").join(format!(
                "dlock-torture-etcd-{}-{}",
                std::process::id(),
                mono()
            ))
        } else {
            dir.join("etcd")
        };
        let mut members = Vec::new();
        for i in 0..3 {
            let d = base.join(format!("m{i}"));
            std::fs::create_dir_all(&d)?;
            members.push(Member {
                name: format!("m{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                dir: d,
                child: None,
            });
        }
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut set = EtcdSet {
            members,
            initial_cluster,
        };
        for i in 0..3 {
            let ic = set.initial_cluster.clone();
            set.members[i].spawn(&ic, "new")?;
        }
        set.wait_healthy(&[0, 1, 2], Duration::from_secs(60))?;
        Ok(set)
    }

    fn wait_healthy(&self, which: &[usize], limit: Duration) -> io::Result<()> {
        let start = mono();
        while !which.iter().all(|&i| healthy(self.members[i].client_port)) {
            if mono() - start > limit.as_nanos() as u64 {
                return Err(io::Error::other(format!(
                    "etcd members {which:?} not healthy within {limit:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn restart(&mut self, i: usize) -> io::Result<()> {
        self.members[i].kill();
        let ic = self.initial_cluster.clone();
        self.members[i].spawn(&ic, "existing")
    }

    /// The leader's index, from a member's `/v3/maintenance/status` (its `leader` is the
    /// member id of the leader; the member whose own id that is, is the leader).
    fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_none() {
                continue;
            }
            let body = "{}";
            let Some(out) = http(
                m.client_port,
                &format!(
                    "POST /v3/maintenance/status HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                ),
            ) else {
                continue;
            };
            let Some(v) = out
                .split("\r\n\r\n")
                .nth(1)
                .and_then(|j| serde_json::from_str::<Value>(j).ok())
            else {
                continue;
            };
            let (me, leader) = (&v["header"]["member_id"], &v["leader"]);
            if !leader.is_null() && me == leader {
                return Some(i);
            }
        }
        None
    }
}

impl Drop for EtcdSet {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
        if let Some(base) = self.members.first().and_then(|m| m.dir.parent()) {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

impl Store for EtcdSet {
    fn url(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn fault(&mut self, rng: &mut Rng, _ttl: Duration) -> io::Result<(&'static str, u64, bool)> {
        let leader = self.leader().unwrap_or(0);
        let follower = (leader + 1 + rng.range(0, 2) as usize) % 3;
        let down = Duration::from_millis(rng.range(1500, 3001));
        let t = mono();
        let kind = match rng.range(0, 5) {
            0 | 1 => {
                let (i, kind) = if rng.range(0, 2) == 0 {
                    (leader, "etcd_kill_leader")
                } else {
                    (follower, "etcd_kill_follower")
                };
                self.members[i].kill();
                std::thread::sleep(down);
                self.restart(i)?;
                self.wait_healthy(&[i], Duration::from_secs(30))?;
                kind
            }
            2 | 3 => {
                let (i, kind) = if rng.range(0, 2) == 0 {
                    (leader, "etcd_stop_leader")
                } else {
                    (follower, "etcd_stop_follower")
                };
                if let Some(pid) = self.members[i].pid() {
                    signal(pid, libc::SIGSTOP);
                    std::thread::sleep(down);
                    signal(pid, libc::SIGCONT);
                }
                self.wait_healthy(&[0, 1, 2], Duration::from_secs(30))?;
                kind
            }
            _ => {
                for i in [leader, follower] {
                    self.members[i].kill();
                }
                std::thread::sleep(down);
                for i in [leader, follower] {
                    self.restart(i)?;
                }
                self.wait_healthy(&[0, 1, 2], Duration::from_secs(30))?;
                "etcd_kill_majority"
            }
        };
        Ok((kind, t, false))
    }
}
