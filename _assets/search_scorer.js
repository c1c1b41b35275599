// The site's search ranking (Sphinx's html_search_scorer): Sphinx's own weights, from
// sphinx/themes/basic/static/searchtools.js, and two tie-breakers. Every page with the
// query in a section title scores the same, and Sphinx then orders them by name, so a
// search for "ZeRO" would open on "Lab 11" (its "Zero-bubble schedules"). A page whose
// own title holds every word of the query comes first, and a chapter before its lab:
// the reader lands on the chapter that explains the concept.
var Scorer = {
  score: (result) => {
    const [docname, title, , , score] = result;
    const query = new URLSearchParams(window.location.search).get("q") || "";
    const words = query.toLowerCase().split(/\s+/).filter((w) => w.length > 0);
    const named = words.length > 0 && words.every((w) => title.toLowerCase().includes(w));
    return score + (named ? 2 : 0) + (docname.startsWith("chapters/") ? 1 : 0);
  },
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: { 0: 15, 1: 5, 2: -5 },
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,
};
