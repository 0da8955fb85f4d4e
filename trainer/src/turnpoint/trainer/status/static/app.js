// The status page (docs/spec.md section 7.13): polls the trainer's REST API and draws
// it. No framework, no build step; every value goes through textContent, never HTML.
"use strict";

const POLL_MS = 1000;
const STORAGE_POLL_MS = 5000;
const PHASE_COLOURS = {
  release: "#8c959f", anchor: "#0969da", close: "#6e7781", drain: "#bf8700",
  retire: "#a475f9", prepare: "#fb8500", commit: "#1a7f37", publish: "#0550ae",
  resume: "#2da44e", abort: "#cf222e", reopen: "#57606a",
};
let selected = null;
let lastStorage = 0;

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  if (value < 1) return (value * 1000).toFixed(0) + " ms";
  return value.toFixed(value < 10 ? 2 : 1) + " s";
}

function bytes(value) {
  if (!value) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let index = 0;
  while (value >= 1024 && index < units.length - 1) { value /= 1024; index += 1; }
  return value.toFixed(index ? 1 : 0) + " " + units[index];
}

// A recorded metric (loss, mean reward): four significant digits, not a float's seventeen.
function metric(value) {
  return typeof value === "number" && !Number.isInteger(value) ? String(Number(value.toPrecision(4))) : String(value);
}

// A count's min and max are whole numbers; its average gets one decimal.
function count(value) {
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

function clock(epochSeconds) {
  if (epochSeconds === null || epochSeconds === undefined) return "–";
  return new Date(epochSeconds * 1000).toLocaleTimeString();
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) {
    const message = body && body.error ? body.error.message : response.statusText;
    throw new Error(path + ": " + response.status + " " + message);
  }
  return body;
}

function showError(message) {
  const box = document.getElementById("error");
  if (message) {
    box.textContent = message;
    box.hidden = false;
  } else {
    box.hidden = true;
    box.textContent = "";
  }
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function drawOverview(job) {
  const counts = job.overview.counts;
  const latest = job.overview.latest;
  const cards = [
    ["triggered", counts.triggered], ["in progress", counts.in_progress],
    ["published", counts.published], ["failed", counts.failed],
    ["skipped", counts.skipped], ["interrupted", counts.interrupted],
    ["restored", counts.restored],
  ].map(([name, value]) => {
    const card = el("div", null, "card");
    card.dataset.count = name;
    card.append(el("b", value), el("span", name));
    return card;
  });
  const last = el("div", null, "card");
  last.append(
    el("span", "latest published: " + (latest.published || "–")), el("br"),
    el("span", "latest failed: " + (latest.failed || "–")), el("br"),
    el("span", "restored from: " + (latest.restored || "–")),
  );
  cards.push(last);
  document.getElementById("overview").replaceChildren(...cards);
  const admission = job.admission;
  document.getElementById("admission").textContent =
    "rollout admission " + (admission.open ? "open" : "CLOSED") +
    (admission.since ? " since " + clock(admission.since) : "");
  const participants = Object.keys(job.participants);
  fill(document.querySelector("#participants tbody"), participants.map((name) => {
    const p = job.participants[name];
    const status = p.status || {};
    const tr = el("tr");
    tr.dataset.participant = name;
    tr.append(
      el("td", name), el("td", p.kind || "–"), el("td", status.phase || "not probed"),
      el("td", status.active_checkpoint_id || ""), el("td", clock(status.lease_expires_at)),
      el("td", status.admission_open === undefined ? "–" : status.admission_open ? "open" : "closed"),
      el("td", status.lease_expiries ?? "–"), el("td", clock(status.answered_at)), el("td", p.address),
    );
    return tr;
  }));
  document.getElementById("job-line").textContent =
    "epoch " + job.epoch + " · " + participants.length + " participant(s) · " +
    "restore from " + job.restore_from;
  document.getElementById("config").textContent = JSON.stringify(job.configuration, null, 2);
  const events = job.events.map((event) => {
    let text = clock(event.at) + " epoch " + event.epoch + ": ";
    if (event.kind === "restore") {
      text += "restored from " + event.checkpoint_id + " in " + seconds(event.restore_s) +
        " (" + event.resumed_rollouts + " resumed, " + event.rerun_rollouts + " rerun)";
    } else if (event.kind === "fresh_start") {
      text += "fresh start (nothing published yet)";
    } else if (event.kind === "trainer_closed") {
      text += "the trainer closed";
    } else if (event.kind === "trainer_ended") {
      text += "CRASH: " + event.detail;
    } else if (event.kind === "participant_replaced") {
      text += "replaced in place: " + event.participants.join(", ") + " (" +
        event.resumed_rollouts + " resumed from " + (event.checkpoint_id || "no snapshot") +
        ", " + event.rerun_rollouts + " rerun, " + event.detail + ")";
    } else {
      text += "participant(s) lost: " + event.participants.join(", ") + " — " + event.detail;
    }
    const item = el("li", text, event.kind === "trainer_ended" ? "caused" : "");
    item.dataset.kind = event.kind;
    item.dataset.epoch = event.epoch;
    if (event.checkpoint_id) item.dataset.checkpoint = event.checkpoint_id;
    return item;
  });
  document.getElementById("events").replaceChildren(...events);
}

function drawLive(open) {
  const live = document.getElementById("live");
  if (!open) {
    live.replaceChildren(el("p", "no snapshot under way", "muted"));
    return;
  }
  const parts = [
    el("p", open.checkpoint_id + ": " + open.state + " for " + seconds(open.duration_s) +
      " so far"),
  ];
  const waiting = Object.entries(open.waiting_for || {});
  if (open.state === "prepare" && waiting.length === 0) {
    parts.push(el("p", "waiting for prepare answers", "muted"));
  }
  for (const [name, why] of waiting) {
    const box = el("div", null, "blocker");
    box.dataset.participant = name;
    box.append(el("b", "waiting for " + name), el("span", ": " + why.why));
    if (why.blockers.length) {
      const list = el("ul");
      for (const blocker of why.blockers) {
        list.append(el("li", blocker.rollout_id + " (attempt " + blocker.attempt + "): " +
          blocker.state + (blocker.detail ? " — " + blocker.detail : "")));
      }
      box.append(list);
    }
    parts.push(box);
  }
  if (open.ready && open.ready.length) {
    parts.push(el("p", "ready: " + open.ready.join(", "), "muted"));
  }
  live.replaceChildren(...parts);
}

function phaseBar(phases, total) {
  const cell = el("td");
  const width = 160;
  for (const [phase, value] of Object.entries(phases)) {
    const part = el("span", null, "bar");
    part.style.width = Math.max(1, Math.round((value / Math.max(total, 1e-9)) * width)) + "px";
    part.style.background = PHASE_COLOURS[phase] || "#999";
    part.title = phase + " " + seconds(value);
    cell.append(part);
  }
  return cell;
}

function drawHistory(body) {
  const rows = body.checkpoints.map((row) => {
    const tr = el("tr");
    tr.dataset.id = row.checkpoint_id;
    if (row.checkpoint_id === selected) tr.className = "selected";
    // Sizes and the admission window are known once an attempt ends; an interrupted one
    // never closed its window.
    const open = row.status === "in_progress";
    tr.append(
      el("td", row.checkpoint_id),
      el("td", row.epoch),
      el("td", row.status.replace("_", " "), "status-" + row.status),
      el("td", row.reason ? row.reason + (row.caused_by.length ? " (" + row.caused_by.join(", ") + ")" : "") : ""),
      el("td", clock(row.triggered_at)),
      el("td", clock(row.latest_acknowledgement_at)),
      el("td", seconds(row.duration_s)),
      el("td", open || row.status === "interrupted" ? "–" : seconds(row.admission_closed_s)),
      el("td", open ? "–" : bytes(row.bytes_written)),
      el("td", open ? "–" : row.records_written),
      el("td", open ? "–" : row.episodes_exported),
      phaseBar(row.phases_s, row.duration_s || 0),
    );
    tr.addEventListener("click", () => select(row.checkpoint_id));
    return tr;
  });
  fill(document.querySelector("#history tbody"), rows);
  document.getElementById("history-empty").hidden = rows.length > 0;
  const summary = Object.entries(body.summary.measures).filter(([, v]) => v).map(([name, v]) => {
    const tr = el("tr");
    const format = name.endsWith("_s") ? seconds : name.startsWith("bytes") ? bytes : count;
    tr.append(el("td", name), el("td", format(v.min)), el("td", format(v.avg)), el("td", format(v.max)));
    return tr;
  });
  fill(document.querySelector("#summary tbody"), summary);
}

async function drawDetail() {
  const section = document.getElementById("detail-section");
  if (!selected) {
    section.hidden = true;
    return;
  }
  const body = await getJson("/api/checkpoints/" + encodeURIComponent(selected));
  const row = body.checkpoint;
  section.hidden = false;
  document.getElementById("detail-id").textContent = row.checkpoint_id;
  document.getElementById("detail-line").textContent =
    row.status.replace("_", " ") + (row.reason ? " (" + row.reason + ")" : "") +
    (row.detail ? ": " + row.detail : "") + " · " + seconds(row.duration_s) +
    (row.retry_of ? " · retry of " + row.retry_of : "");
  const rows = Object.entries(row.participants).map(([name, p]) => {
    const tr = el("tr");
    tr.dataset.participant = name;
    tr.append(
      el("td", name, p.caused_failure ? "caused" : ""),
      el("td", seconds(p.prepare_s)), el("td", seconds(p.commit_s)), el("td", seconds(p.resume_s)),
      el("td", clock(p.acknowledged_at)), el("td", bytes(p.bytes_written)),
      el("td", p.records_written), el("td", p.episodes_exported),
      el("td", p.failure || "", "wrap" + (p.caused_failure ? " caused" : "")),
    );
    return tr;
  });
  fill(document.querySelector("#detail tbody"), rows);
}

function select(id) {
  selected = id;
  for (const tr of document.querySelectorAll("#history tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.id === id);
  }
  drawDetail().catch((error) => showError(String(error.message || error)));
}

async function drawStorage(verify) {
  const body = await getJson("/api/snapshots" + (verify ? "?verify=1" : ""));
  const order = body.restore.order;
  document.getElementById("restore-line").textContent =
    "restore_from = " + body.restore.restore_from + "; a restart tries " +
    (order.length ? order.join(", ") : "nothing (fresh start)") + " in that order";
  const rows = body.snapshots.map((snap) => {
    const tr = el("tr");
    tr.dataset.snapshot = snap.checkpoint_id;
    const metrics = snap.metrics ? Object.entries(snap.metrics).map(([k, v]) => k + "=" + metric(v)).join(", ") : "";
    const rank = order.indexOf(snap.checkpoint_id);
    const verified = snap.verified === null ? "not checked" :
      snap.verified.ok ? "OK (" + snap.verified.files_checked + " files)" : "MISMATCH: " + snap.verified.problem;
    tr.append(
      el("td", snap.checkpoint_id), el("td", snap.step ?? "–"), el("td", clock(snap.created_at)),
      el("td", metrics), el("td", snap.latest ? "LATEST" : ""),
      el("td", rank >= 0 ? "#" + (rank + 1) : snap.readable ? "" : "unreadable"),
      el("td", verified, "wrap"),
    );
    return tr;
  });
  fill(document.querySelector("#restore tbody"), rows);
}

async function poll() {
  try {
    const [jobBody, history] = await Promise.all([
      getJson("/api/job"), getJson("/api/checkpoints?limit=200"),
    ]);
    drawOverview(jobBody.job);
    drawLive(jobBody.job.open_snapshot);
    drawHistory(history);
    if (selected) await drawDetail();
    if (Date.now() - lastStorage > STORAGE_POLL_MS) {
      lastStorage = Date.now();
      await drawStorage(false);
    }
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    showError(null);
  } catch (error) {
    showError("cannot read the trainer's status: " + String(error.message || error));
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("detail-close").addEventListener("click", () => {
  selected = null;
  for (const tr of document.querySelectorAll("#history tbody tr.selected")) tr.classList.remove("selected");
  document.getElementById("detail-section").hidden = true;
});
document.getElementById("verify").addEventListener("click", () => {
  drawStorage(true).catch((error) => showError(String(error.message || error)));
});
poll();
