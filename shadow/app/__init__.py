"""The top floor: assembles processes from every wing below (`demo`: fleet + router + serve + load)
and the metric catalogue from every exporter's declared families (`catalogue`)."""
