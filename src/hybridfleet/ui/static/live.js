// A live run's page: its figures follow the run's server-sent events (/runs/JOB/STAMP/events).
// Text only goes in with textContent; no markup is ever built from what the server sends.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live || !window.EventSource) {
    return;
  }
  var source = new EventSource(live.getAttribute("data-events"));

  function setText(id, text) {
    var node = document.getElementById(id);
    if (node) {
      node.textContent = text;
    }
  }

  function setSites(sites, metricKey) {
    var table = document.getElementById("sites");
    if (!table) {
      return;
    }
    var heads = table.querySelectorAll("th");
    if (heads.length) {
      heads[heads.length - 1].textContent = metricKey;  // the last column: the job's own metric
    }
    var rows = table.querySelectorAll("tr");
    for (var i = 1; i < rows.length; i++) {
      rows[i].parentNode.removeChild(rows[i]);
    }
    var body = rows.length ? rows[0].parentNode : table;
    sites.forEach(function (site) {
      var tr = document.createElement("tr");
      if (site[6] === true) {
        tr.className = "final";
      }
      for (var c = 0; c < 6; c++) {
        var td = document.createElement("td");
        td.textContent = String(site[c]);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    });
  }

  source.addEventListener("progress", function (message) {
    var data = JSON.parse(message.data);
    setText("progress", data.progress);
    setSites(data.sites || [], data.metric_key);
  });

  source.addEventListener("end", function (message) {
    source.close();
    var data = JSON.parse(message.data);
    setText("status", String(data.status).toUpperCase());
    setText("live", "The run has ended (" + data.status + "): reload the page for its summary.");
  });

  source.addEventListener("error", function () {
    // The browser reconnects by itself; a refused stream (503) closes it: say so rather than stay silent.
    if (source.readyState === EventSource.CLOSED) {
      setText("live", "Live updates are unavailable now: reload the page for new figures.");
    }
  });
})();
