// The site's error matcher: the answer `fixbook search` gives (fixes/search.py, without a release),
// shown above the site search's results, so a page that merely contains the words of an unrelated
// error is never presented as the entry that explains it. The evidence comes from the Python side
// (generated/search-evidence.json, written by ci/site/); a browser test checks that this file and
// fixes/search.py answer every labelled query alike.
(function () {
  "use strict";
  const script = document.currentScript;
  let data = null;

  // fixes.search._EXCEPTION, one line at a time: "Type: message" (a dotted type ending in Error, Exception or Interrupt).
  const EXCEPTION = /^\s*(?:(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)|Fatal Python error):\s?.*$/;
  const RANK_PREFIX = /^\s*\[?rank\s*\d+\]?:\s?/gim;
  const FRAME = /File "([^"]+)", line \d+,? in ([\w<>.]+)/g;
  const escape = (text) => text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

  // Rejoin `File "…", line N, in f` lines a terminal or a chat window wrapped (fixes.search._unwrap_frames).
  function unwrapFrames(text) {
    const out = [];
    for (const line of text.split(/\r?\n/)) {
      const previous = out.length ? out[out.length - 1] : "";
      FRAME.lastIndex = 0;
      if (/^\s*File "/.test(previous) && !new RegExp(FRAME.source).test(previous)) {
        const quotes = (previous.match(/"/g) || []).length;
        out[out.length - 1] = previous + (quotes % 2 ? "" : " ") + line.trim();
      } else {
        out.push(line);
      }
    }
    return out.join("\n");
  }

  function parse(text) {
    const clean = unwrapFrames(text.replace(RANK_PREFIX, ""));
    const frames = [];
    let anyFrame = false;
    for (const m of clean.matchAll(FRAME)) {
      anyFrame = true;
      const path = m[1].replace(/\\/g, "/");
      if (path.includes("deepspeed/")) {
        frames.push(["deepspeed/" + path.split("deepspeed/").pop(), m[2]]);
      }
    }
    const lower = clean.toLowerCase();
    return { text: clean, frames, hasTraceback: anyFrame, flat: lower.split(/\s+/).filter(Boolean).join(" "),
             dense: lower.replace(/\s+/g, "") };
  }

  function words(text) {
    const stop = new Set(data.stopwords);
    return new Set((text.toLowerCase().match(/[a-z0-9_]+/g) || []).filter((w) => w.length > 2 && !stop.has(w)));
  }

  const plainWords = (text) => text.toLowerCase().match(/[a-z0-9_]+/g) || [];

  // The first run of `fragment_words` consecutive words of an error line the paste has (fixes.search._fragment).
  function fragment(pasteWords, line) {
    const n = data.fragment_words;
    if (line.length < n) return "";
    const grams = new Set();
    for (let i = 0; i + n <= pasteWords.length; i++) grams.add(pasteWords.slice(i, i + n).join("\u0000"));
    const template = new Set(data.template_words);
    for (let i = 0; i + n <= line.length; i++) {
      const run = line.slice(i, i + n);
      if (grams.has(run.join("\u0000")) && run.filter((w) => !template.has(w)).length >= data.fragment_content) {
        return run.join(" ");
      }
    }
    return "";
  }

  // fixes.prose: the stemmer, the tokenizer and BM25 (rank_bm25's Okapi) over the index the build writes.
  function stem(word) {
    if (word.length <= 4 || !/^[a-z]+$/.test(word)) return word;
    for (const suffix of ["ing", "ed", "es", "s"]) {
      if (word.endsWith(suffix) && !word.endsWith("ss") && word.length - suffix.length >= 3) {
        word = word.slice(0, -suffix.length);
        break;
      }
    }
    return word.endsWith("e") && word.length > 4 ? word.slice(0, -1) : word;
  }

  const CAMEL = /(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])/;
  const STAGE = /\bzero[\s_-]*(?:optimization[\s._-]*)?(?:stage[\s_=:"'-]*)?(\d)\b|\bstage[\s_=:"'-]*(\d)\b/gi;
  function tokens(text) {
    const stop = new Set(data.prose_stopwords);
    const found = [];
    for (const m of text.matchAll(STAGE)) found.push("zero" + (m[1] || m[2]));
    for (const raw of text.match(/[A-Za-z0-9_]+/g) || []) {
      const parts = raw.split("_").flatMap((piece) => piece.length >= 6 ? piece.split(CAMEL) : [piece]).filter(Boolean);
      for (const word of [...new Set(parts.length > 1 ? [raw, ...parts] : [raw])]) {
        const low = word.toLowerCase();
        if (low.length > 1 && !stop.has(low)) found.push(stem(low));
      }
    }
    return found;
  }

  function proseRank(text) {
    const index = data.prose;
    const query = new Map();
    for (const raw of text.match(/[A-Za-z0-9_]+/g) || []) {
      for (const term of tokens(raw)) if (!query.has(term)) query.set(term, raw);
    }
    const found = new Map();
    if (!query.size) return found;
    for (const doc of index.docs) {
      let score = 0;
      for (const term of query.keys()) {
        const tf = doc.tf[term] || 0;
        score += (index.idf[term] || 0) * (tf * (index.k1 + 1) / (tf + index.k1 * (1 - index.b + index.b * doc.len / index.avgdl)));
      }
      const shared = [...query.keys()].filter((term) => doc.tf[term]).map((term) => query.get(term));
      const distinct = [...new Set(shared)];
      if (distinct.length >= index.min_words && score >= index.min_score) {
        found.set(doc.key, { score: Math.round(score * 1e6) / 1e6, words: distinct });
      }
    }
    return found;
  }

  function contains(paste, signature) {
    const flatSig = signature.toLowerCase().split(/\s+/).filter(Boolean).join(" ");
    if (new RegExp("(?<![\\w])" + escape(flatSig) + "(?![\\w])").test(paste.flat)) return true;
    const denseSig = signature.toLowerCase().replace(/\s+/g, "");
    return denseSig.length >= 24 && paste.dense.includes(denseSig);
  }

  // fixes.search.report_names: the schedulers, optimizer classes and ZeRO stages a report names.
  function reportNames(paste) {
    const named = {};
    for (const family of data.families) named[family] = new Set();
    for (const [name, bases] of Object.entries(data.schedulers)) {
      if (new RegExp("\\b" + escape(name) + "\\b").test(paste.text)) [name, ...bases].forEach((n) => named.scheduler.add(n));
    }
    for (const name of data.optimizers) {
      if (new RegExp("\\b" + escape(name) + "\\b").test(paste.text)) named.optimizer.add(name);
    }
    for (const pattern of data.stage_patterns) {
      for (const m of paste.text.matchAll(new RegExp(pattern, "gi"))) named["ZeRO stage"].add(m[1]);
    }
    for (const [path] of paste.frames) for (const stage of data.stage_files[path] || []) named["ZeRO stage"].add(stage);
    return named;
  }

  // fixes.search.contradiction: why the report cannot be of the entry's bug, "" where it can.
  function contradiction(paste, known) {
    const named = reportNames(paste);
    for (const [family, members] of known.about) {
      const names = [...named[family]];
      if (names.length && !names.some((name) => members.includes(name))) {
        const bases = new Set(names.flatMap((name) => data.schedulers[name] || []));
        const shown = names.filter((name) => !bases.has(name)).sort();
        return `but the text names ${family} ${shown.join(", ")}, and this entry is about ${family} ` +
          [...members].sort().join(" or ");
      }
    }
    return "";
  }

  function match(paste, known) {
    const why = [];
    let score = 0;
    const common = new Set(data.common_functions);
    const code = new Set(known.code.map((pair) => pair.join("\u0000")));
    let specific = known.specific.filter((s) => contains(paste, s));
    if (!specific.length) {
      const words = plainWords(paste.text);
      const fragments = known.error_lines.map((line) => fragment(words, line)).filter(Boolean);
      if (fragments.length) {
        specific = fragments;
        why.push(`part of its error text: '${fragments[0]}'`);
      }
    }
    const rare = new Set(data.rare);
    const identifiers = known.identifiers.filter((name) => rare.has(name) &&
      new RegExp("(?<![\\w.])" + escape(name) + "(?![\\w])").test(paste.text)).sort();
    const generic = known.generic.filter((g) => contains(paste, g.signature) || (g.phrase && contains(paste, g.phrase)));
    const frameFunctions = [...new Set(paste.frames.filter(([path, f]) => code.has(path + "\u0000" + f) ||
      (known.functions.includes(f) && !common.has(f))).map(([, f]) => f))].sort();
    const frameFiles = [...new Set(paste.frames.filter(([path]) => known.files.includes(path)).map(([p]) => p))].sort();
    const innermost = paste.frames.length ? paste.frames[paste.frames.length - 1] : null;
    const pasteWords = words(paste.text);
    let described = 0;
    for (const list of known.descriptive) {
      if (list.length) described = Math.max(described, list.filter((w) => pasteWords.has(w)).length / list.length);
    }
    if (specific.length) {
      score += 3 + 0.01 * Math.max(...specific.map((s) => s.length));
      if (!why.length) why.push(`its error text: '${specific[0]}'`);
    }
    if (generic.length) { score += 1; why.push(`a common message it explains: '${generic[0].signature}'`); }
    if (frameFunctions.length) {
      score += 1 + Math.min(frameFunctions.length, 3) * 0.5;
      if (innermost && frameFunctions.includes(innermost[1])) score += 1;
      why.push(`raised in the code it names: ${frameFunctions.join(", ")}`);
    } else if (frameFiles.length) {
      score += 1;
      why.push(`DeepSpeed frames in ${frameFiles.join(", ")}`);
    }
    let level;
    const named = known.names.filter((name) => new RegExp("\\b" + escape(name) + "\\b").test(paste.text)).sort();
    if (named.length && (specific.length || generic.length || frameFiles.length)) {
      score += 0.5;
      why.push(`its code is named: ${named.join(", ")}`);
    }
    const contradicts = contradiction(paste, known);
    if ((specific.length || (generic.length && (frameFunctions.length || frameFiles.length))) && !contradicts) level = "strong";
    else if (specific.length || (generic.length && (frameFunctions.length || frameFiles.length))) {
      level = "possible";  // the error fits, but what the text names is not what the entry is about
      why.push(contradicts);
    } else if (generic.length && paste.hasTraceback && !paste.frames.length) level = "no match";
    else if (generic.length || frameFunctions.length || identifiers.length || (described >= 0.75 && known.descriptive.length)) {
      level = "possible";
      if (identifiers.length && !(generic.length || frameFunctions.length)) {
        score += 0.5;
        why.push(`names ${identifiers.join(", ")} from its error text`);
      }
      if (described >= 0.75 && !(generic.length || frameFunctions.length)) score += described;
    } else level = "no match";
    return { id: known.id, title: known.title, level, score, why };
  }

  const LEVELS = ["strong", "possible", "no match"];

  // What a person wrote or an error said, without a traceback's scaffolding (fixes.search.prose_text).
  function proseText(text) {
    const kept = [];
    let afterFrame = false;
    for (const line of text.split(/\r?\n/)) {
      const frame = new RegExp(FRAME.source).test(line);
      if (frame || line.trim().startsWith("Traceback (most recent call last)")) { afterFrame = frame; continue; }
      if (/^\s*(?:\^+|~+[\^~]*)\s*$/.test(line) || (afterFrame && /^[ \t]/.test(line)) || EXCEPTION.test(line)) continue;
      afterFrame = false;
      kept.push(line);
    }
    return kept.join("\n");
  }

  function search(text) {
    const paste = parse(text);
    const elsewhere = paste.hasTraceback && !paste.frames.length;
    const prose = elsewhere ? new Map() : proseRank(proseText(paste.text));
    return data.entries.map((known) => {
      const result = match(paste, known);
      const ranked = prose.get(known.id);
      if (ranked) {
        result.score += (result.level === "strong" ? data.prose_tie : data.prose_weight) * ranked.score;
        if (result.level === "no match") result.level = "possible";
        if (result.level === "possible") result.why.push(`its description shares: ${ranked.words.join(", ")}`);
      }
      return result;
    }).filter((m) => m.level !== "no match")
      .sort((a, b) => LEVELS.indexOf(a.level) - LEVELS.indexOf(b.level) || b.score - a.score ||
        (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  }

  function looksLikeAnError(text) {  // or a described symptom: a few words, not a single one
    return /(Error|Exception|Traceback|Fatal|fault|assert|Signal)/i.test(text) || (text.match(/\w+/g) || []).length >= 3;
  }

  function render(query) {
    const results = document.querySelector(".md-search-result");
    if (!results || !data) return;
    let box = document.getElementById("fixbook-verdict");
    if (!looksLikeAnError(query)) { if (box) box.remove(); return; }
    if (!box) {
      box = document.createElement("div");
      box.id = "fixbook-verdict";
      box.className = "md-typeset";
      box.style.cssText = "padding: .6rem 1.2rem; border-bottom: 1px solid var(--md-default-fg-color--lightest);";
      results.prepend(box);
    }
    const found = search(query);
    const base = new URL("../generated/entries/", script.src);
    box.innerHTML = found.length
      ? "<strong>Error matcher</strong> (as <code>fixbook search</code>): " + found.slice(0, 3).map((m) =>
          `<span data-level="${m.level}">${m.level}: <a href="${new URL(m.id + "/", base)}">${m.title}</a></span>`)
          .join(" · ") + ". The results below are pages containing these words."
      : "<strong>Error matcher</strong> (as <code>fixbook search</code>): <span data-level=\"no match\">no match</span>" +
        " — no entry explains this error. Pages below merely contain some of its words.";
  }

  window.fixbookMatch = (text) => search(text).map((m) => ({ id: m.id, level: m.level }));

  fetch(new URL("../generated/search-evidence.json", script.src)).then((r) => r.json()).then((json) => {
    data = json;
    window.fixbookMatchReady = true;
    document.addEventListener("input", (event) => {
      if (event.target.matches && event.target.matches("input.md-search__input")) {
        setTimeout(() => render(event.target.value), 50);
      }
    });
  });
})();
