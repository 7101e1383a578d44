// Counters of a running Kafka broker read over JMX (the attach API starts its local agent):
// requests by type, bytes in and out, GC collections. `bench.broker_share` runs it beside a
// broker (`java bench/KafkaCounts.java PID`) and writes a line to its stdin whenever it wants a
// sample; each sample is one line of JSON, {"name": count, ...}.
import com.sun.tools.attach.VirtualMachine;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.Map;
import java.util.TreeMap;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;

public class KafkaCounts {
    public static void main(String[] args) throws Exception {
        VirtualMachine vm = VirtualMachine.attach(args[0]);
        String url = vm.startLocalManagementAgent();
        vm.detach();
        MBeanServerConnection jmx = JMXConnectorFactory.connect(new JMXServiceURL(url)).getMBeanServerConnection();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        System.out.println("{}");  // ready
        while (in.readLine() != null) {
            Map<String, Number> counts = new TreeMap<>();
            add(jmx, counts, "kafka.network:type=RequestMetrics,name=RequestsPerSec,*", "Count", "request");
            add(jmx, counts, "kafka.server:type=BrokerTopicMetrics,*", "Count", "name");
            add(jmx, counts, "java.lang:type=GarbageCollector,*", "CollectionCount", "name");
            add(jmx, counts, "java.lang:type=GarbageCollector,*", "CollectionTime", "name");
            StringBuilder line = new StringBuilder("{");
            counts.forEach((k, v) -> line.append(line.length() > 1 ? ", " : "").append('"').append(k).append("\": ").append(v));
            System.out.println(line.append('}'));
        }
    }

    /** Sums `attribute` over the beans matching `pattern`, by their `key` property (topic-level beans left out). */
    static void add(MBeanServerConnection jmx, Map<String, Number> counts, String pattern, String attribute, String key)
            throws Exception {
        for (ObjectName name : jmx.queryNames(new ObjectName(pattern), null)) {
            if (name.getKeyProperty("topic") != null) continue;
            Object value;
            try { value = jmx.getAttribute(name, attribute); } catch (Exception e) { continue; }
            String label = name.getKeyProperty("type") + "." + name.getKeyProperty(key) + "." + attribute;
            counts.merge(label, ((Number) value).longValue(), (a, b) -> a.longValue() + b.longValue());
        }
    }
}
